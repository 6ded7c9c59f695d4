"""What a peer is: another system timed beside our methods on the same prompt ids (``--compare``).

A peer kind (``genai``, ``llamacpp``) is one module with a ``require()`` (fail before anything
slow when its package is missing) and a ``load_peers(ctx)`` that builds or locates what it runs
and returns its :class:`Peer` objects, plain decoding first, then its own speculative decoding
(``genai-ngram``, ``llamacpp-lookup``), each checked by a short generation; a peer that cannot
run is one warning line and the bench goes on. The runner, the report and the chart know peers
only through :data:`KINDS`: a fourth peer is one module and one line here (docs/extending.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, cast

from ..schema import INT8


@dataclass
class PeerResult:
    """One peer generation: ids and the same timing fields as our GenerationStats."""

    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    total_s: float
    step_s: list[float] = field(default_factory=list)  # each decode step (a forward + sampling)
    stop_reason: str = "length"
    forwards: int | None = None  # speculative: target forwards after the first token
    speculative: dict | None = None  # speculative: the peer's own counts of the whole generation

    @property
    def steps(self) -> int:
        return len(self.step_s) if self.forwards is None else self.forwards

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 and len(self.tokens) > 1 else 0.0


class Peer(Protocol):
    """One timed system: ``name`` is its method name in the records."""

    name: str

    def generate(self, ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False) -> PeerResult: ...

    def describe(self) -> dict: ...

    def quality(self, model_folder: str | Path) -> dict: ...


@dataclass(frozen=True)
class PeerKind:
    """A ``--compare`` entry: the records' method names it times (plain first) and its module."""

    name: str
    methods: tuple[str, ...]
    module: str  # relative to this package, imported only when the peer is asked for (an extra)
    label: str  # what the table, chart and docs call it
    params: tuple[tuple[str, str], ...] = ()  # keyword arguments of the module's load_peers

    def _mod(self) -> Any:
        return importlib.import_module(self.module, __package__)

    def require(self) -> None:
        """A missing package: one line (DejavuuError) before anything slow."""
        self._mod().require()

    def load(self, ctx: Any) -> list[Peer]:
        """Its peers for this run (``ctx``: a ``runner.PeerContext``), plain first; [] if it cannot run."""
        return cast(list, self._mod().load_peers(ctx, **dict(self.params)))


KINDS: dict[str, PeerKind] = {
    k.name: k
    for k in (
        PeerKind("genai", ("genai", "genai-ngram"), ".genai", "onnxruntime-genai"),
        # genai at 8 bits, where it keeps the model's answers as our default does (bench.genai)
        PeerKind("genai-int8", ("genai-int8",), ".genai", "onnxruntime-genai int8", (("precision", INT8),)),
        PeerKind("llamacpp", ("llamacpp", "llamacpp-lookup"), ".llamacpp", "llama.cpp"),
    )
}
PEER_METHODS: tuple[str, ...] = tuple(m for k in KINDS.values() for m in k.methods)
# a peer's speculative decoding -> its own plain decoding (whose tokens it is matched with)
PLAIN_OF: dict[str, str] = {m: k.methods[0] for k in KINDS.values() for m in k.methods[1:]}


def column(method: str) -> str:
    """The results' column of decode tok/s over ``method``'s: ``x_genai``, ``x_llamacpp_lookup``."""
    return "x_" + method.replace("-", "_")


def one_line(e: BaseException) -> str:
    """An exception's message on one line (peers' libraries raise multi-line ones)."""
    return " ".join(str(e).split()) or type(e).__name__


def peer_quality(
    replay: Any, model_folder: str | Path, threads: int, context_length: int = 0, name: str = "peer"
) -> dict:
    """A peer's logits scored by our build's quality gate: teacher-forced top-1 agreement with our
    fp32 export and mean KL(fp32 || peer) over the same quality set and positions as our variants
    (``build.quality.gate_quality``), so speed is read beside how much of the model each keeps.
    ``replay.logits(ids)`` gives every position's logits of one teacher-forced pass."""
    from types import SimpleNamespace

    from ..build.quality import gate_quality, scoring_set
    from ..build.references import Reference
    from ..build.runner import Runner
    from ..runtime.session import make_session
    from ..schema import FP32, REFERENCE_FILE, read_contract, variant_file

    folder = Path(model_folder)
    contract = read_contract(folder)
    fp32 = Runner(make_session(folder / variant_file(FP32), threads=threads), contract)
    ref = Reference.load(folder / REFERENCE_FILE) if (folder / REFERENCE_FILE).is_file() else None
    qs = scoring_set(folder, fp32, ref, min(x for x in (contract.position_limit, context_length) if x))
    teacher = SimpleNamespace(prefill=lambda ids: (replay.logits(ids), None, None))
    # duck-typed: gate_quality calls only Runner.prefill, which this shape provides
    g = gate_quality(fp32, {name: cast(Runner, teacher)}, qs, {})[name]
    return {k: g[k] for k in ("top1", "agree", "positions", "mean_kl", "texts", "set", "set_sha256")}
