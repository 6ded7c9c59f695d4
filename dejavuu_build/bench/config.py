"""What a bench run is: its config, its prompts (Spec-Bench rows, chosen per category), its errors.

Apart from the loop (:mod:`.runner`) so that the peers and the n-gram sweep, which the loop
loads, need only this module: no import circle between the loop and what it runs.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Callable, Sequence

from .. import schema as S
from ..errors import DejavuuError
from ..log import logger
from ..rows import json_row, not_utf8
from ..runtime.settings import DecodeSettings
from .peer import KINDS, PEER_METHODS

TASK_CATEGORIES: tuple[str, ...] = ("translation", "summarization", "qa", "math_reasoning", "rag")
DEFAULT_CATEGORIES: tuple[str, ...] = (*TASK_CATEGORIES, "mt_bench")
# Spec-Bench files its 80 MT-Bench prompts under MT-Bench's own 8 categories.
MT_BENCH_SOURCES = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
SPEC_BENCH_HINT = (
    "pass --data PATH to Spec-Bench's question.jsonl (https://github.com/hemingkx/Spec-Bench, "
    "file data/spec_bench/question.jsonl)"
)
# Plain decoding on ORT's one-row kernel path: the fastest plain decoding, but its logits differ in
# the last bits from multi-row forwards (see Decoder.forward), so it is timed, not gated.
RAW_BASELINE = "baseline_n1"
# "<method>+tree" runs that method with tree verification in the same run (chain vs tree on the
# same prompts, interleaved), whatever --tree says for the plain names.
TREE_SUFFIX = "+tree"


def base_method(method: str) -> str:
    return method[: -len(TREE_SUFFIX)] if method.endswith(TREE_SUFFIX) else method


PEERS: tuple[str, ...] = tuple(KINDS)  # --compare: other systems, timed on the same prompt ids (bench.peer)
GENAI = "genai"  # the peer whose n-gram options BenchConfig.genai_ngram carries
# the peers a context sweep can time: genai's builds (plain decoding through its own generator)
SWEEP_PEERS = tuple(k.name for k in KINDS.values() if k.module == ".genai")
NGRAM_SWEEP, NGRAM_OFF = "sweep", "off"  # BenchConfig.genai_ngram, besides a fixed "N,K"


class BenchError(DejavuuError):
    """The benchmark cannot run as asked (no data, unknown category or method, resume mismatch)."""


@dataclass(frozen=True)
class Prompt:
    qid: str
    category: str  # the bench category (mt_bench for all 8 MT-Bench categories)
    source: str  # the category as written in the data file
    turns: tuple[str, ...]


@dataclass
class BenchConfig:
    model: str
    methods: tuple[str, ...] = ("baseline", "pld")
    categories: tuple[str, ...] = DEFAULT_CATEGORIES
    per_category: int = 10
    skip: int = 0  # the first this many fitting prompts of each category are left out (held-out runs)
    max_new_tokens: int = S.DEFAULT_MAX_NEW_TOKENS
    threads: int = S.DEFAULT_THREADS
    tree: bool = False
    width: int = S.DEFAULT_TREE_WIDTH
    variant: str | None = None
    temperature: float = 0.0
    seed: int = 0
    datastore: str | None = None
    data: str | None = None
    compare: tuple[str, ...] = ()  # peer kinds timed beside our methods (bench.peer.KINDS)
    contexts: tuple[int, ...] = ()  # a context sweep instead of Spec-Bench categories (bench.sweep)
    repeats: int = 1  # sweep: runs per context (medians are reported)
    verify_rows: tuple[int, ...] = ()  # sweep: also time verify steps of these graph row counts (bench.sweep)
    anatomy: bool = False  # sweep: profile a decode step by op type, ours vs genai's graph (bench.anatomy)
    # with --compare genai, genai's n-gram speculative decoding too: "sweep" (pick its options on
    # prompts outside the measured set, bench.ngram), a fixed "N,K", or "off"
    genai_ngram: str = NGRAM_SWEEP

    # What a resumed run must share with the run it continues: anything that changes the
    # generated tokens or the timings. Categories, prompt counts and the data path may grow.
    RESUME_KEYS = (
        "model",
        "variant",
        "methods",
        "max_new_tokens",
        "threads",
        "tree",
        "width",
        "temperature",
        "seed",
        "datastore",
        "compare",
        "genai_ngram",
        "skip",
    )

    def __post_init__(self) -> None:
        from ..runtime.drafters import METHODS

        methods = ["baseline"] + [m for m in self.methods if m != "baseline"]
        self.methods = tuple(dict.fromkeys(methods))
        if theirs := [m for m in self.methods if m in PEER_METHODS]:
            raise BenchError(f"{', '.join(theirs)} is not one of our methods: time it with --compare")
        self.compare = tuple(dict.fromkeys(self.compare))
        if bad := [c for c in self.compare if c not in PEERS]:
            raise BenchError(f"unknown --compare {', '.join(bad)}; choose from: {', '.join(PEERS)}")
        if self.compare and self.temperature > 0.0:
            raise BenchError("--compare times greedy decoding only: drop --temperature")
        self.genai_ngram = str(self.genai_ngram or NGRAM_OFF).replace(" ", "")
        if self.genai_ngram not in (NGRAM_SWEEP, NGRAM_OFF):
            n, k = parse_ngram(self.genai_ngram)
            self.genai_ngram = f"{n},{k}"
            if GENAI not in self.compare:
                raise BenchError("--genai-ngram times genai's n-gram speculative decoding: add --compare genai")
            if self.contexts:
                raise BenchError("--genai-ngram is part of the Spec-Bench run; a context sweep times plain decoding")
        if GENAI not in self.compare or self.contexts:
            self.genai_ngram = NGRAM_OFF  # nothing to run it beside; recorded as such
        self.contexts = tuple(int(c) for c in self.contexts)
        if self.contexts and (other := [c for c in self.compare if c not in SWEEP_PEERS]):
            raise BenchError(
                f"the context sweep compares with {' and '.join(SWEEP_PEERS)} only (not {', '.join(other)}): "
                "drop --contexts"
            )
        if any(c < 1 for c in self.contexts) or self.repeats < 1:
            raise BenchError("--contexts and --repeats take positive numbers")
        self.verify_rows = tuple(dict.fromkeys(int(r) for r in self.verify_rows))
        if any(r < 2 for r in self.verify_rows):
            raise BenchError("--verify-rows takes row counts of 2 or more (1 row is plain decoding, always timed)")
        if self.verify_rows and not self.contexts:
            raise BenchError("--verify-rows is part of the context sweep: add --contexts 256,1024,...")
        if self.anatomy and not self.contexts:
            raise BenchError("--anatomy is part of the context sweep: add --contexts 256 (it profiles the first)")
        bad = [m for m in self.methods if base_method(m) not in METHODS and m != RAW_BASELINE]
        if bad:
            raise BenchError(f"unknown method(s) {', '.join(bad)}; choose from: {', '.join(METHODS)}, {RAW_BASELINE}")
        self.categories = tuple(dict.fromkeys(self.categories))
        if not self.categories:
            raise BenchError("no categories to run")
        if self.per_category < 1 or self.max_new_tokens < 1:
            raise BenchError("--per-category and --max-new-tokens must be at least 1")
        if self.skip < 0:
            raise BenchError("--skip takes a count of prompts to leave out per category (0 or more)")

    @property
    def settings(self) -> DecodeSettings:
        """How every method decodes in this run (its method and tree are set per run, with replace)."""
        return DecodeSettings(
            width=self.width, max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=self.seed
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def ngram(self) -> bool:
        """Whether genai's n-gram speculative decoding is timed beside its plain decoding."""
        return self.genai_ngram != NGRAM_OFF

    @property
    def peer_methods(self) -> tuple[str, ...]:
        """The peers' records, each kind's plain decoding before its speculative one (genai's n-gram
        decoding only with ``genai_ngram``)."""
        out: list[str] = []
        for k in self.compare:
            out += KINDS[k].methods[: 1 if k == GENAI and not self.ngram else None]
        return tuple(out)

    @property
    def timed(self) -> tuple[str, ...]:
        """Everything run per prompt: our methods (baseline first), then the peers."""
        return (*self.methods, *self.peer_methods)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("methods", "categories", "compare", "contexts", "verify_rows"):
            d[k] = list(getattr(self, k))
        return d


# ---------------------------------------------------------------------------------- prompts
def bench_category(raw: str) -> str:
    return "mt_bench" if raw in MT_BENCH_SOURCES else raw


def default_data_path() -> Path | None:
    """Spec-Bench next to the project checkout, else next to the current directory."""
    import dejavuu_build

    rel = Path("shared", "data", "spec_bench", "question.jsonl")
    for base in (Path(dejavuu_build.__file__).resolve().parents[1].parent, Path.cwd().parent):
        if (base / rel).is_file():
            return base / rel
    return None


def resolve_data(path: str | os.PathLike | None) -> Path:
    if path is None:
        found = default_data_path()
        if found is None:
            raise BenchError(f"no Spec-Bench data found: {SPEC_BENCH_HINT}")
        return found
    p = Path(path).expanduser()
    if not p.is_file():
        raise BenchError(f"{p} is not a file: {SPEC_BENCH_HINT}")
    return p


def read_prompts(path: Path) -> list[Prompt]:
    """Rows ``{"question_id", "category", "turns": [...]}``, in file order."""
    out: list[Prompt] = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:  # not JSON, nested too deeply, a lone surrogate, or not such a row
                    row = json_row(line, f"{path}:{n}")
                    turns = tuple(str(t) for t in row["turns"])
                    qid, raw = str(row["question_id"]), str(row["category"])
                except (ValueError, KeyError, TypeError) as e:
                    raise BenchError(
                        f"{path}:{n}: not a Spec-Bench row {{question_id, category, turns}} ({e})"
                    ) from None
                if turns:
                    out.append(Prompt(qid, bench_category(raw), raw, turns))
    except UnicodeDecodeError as e:
        raise BenchError(not_utf8(path, e)) from None
    return out


def select(
    prompts: Sequence[Prompt],
    categories: Sequence[str],
    n: int,
    fits: Callable[[Prompt], bool] = lambda p: True,
    skip: int = 0,
) -> list[Prompt]:
    """The first ``n`` prompts of each category that fit the model, deterministically; with
    ``skip``, the ``n`` after the first ``skip`` of them (prompts the default run never measures:
    a held-out check of anything tuned on the default set).

    Within a category the source categories take turns (MT-Bench: writing, roleplay, ...), so a
    small ``n`` still samples all of mt_bench rather than its first 10 writing prompts.
    """
    by_cat = _by_category(prompts)
    missing = [c for c in categories if c not in by_cat]
    if missing:
        raise BenchError(
            f"no prompts for categor{'y' if len(missing) == 1 else 'ies'} {', '.join(missing)} in the "
            f"data; it has: {', '.join(by_cat)}"
        )
    chosen: list[Prompt] = []
    for cat in categories:
        picked = list(islice(filter(fits, _interleaved(by_cat[cat])), skip, skip + n))
        if len(picked) < n:
            logger.warning(
                "%s: only %d of the %d prompts asked for (of %d in the data%s) fit the model",
                cat,
                len(picked),
                n,
                len(_interleaved(by_cat[cat])),
                f", the first {skip} that fit left out" if skip else "",
            )
        chosen += picked
    return chosen


def _by_category(prompts: Sequence[Prompt]) -> dict[str, dict[str, list[Prompt]]]:
    by_cat: dict[str, dict[str, list[Prompt]]] = defaultdict(lambda: defaultdict(list))
    for p in prompts:
        by_cat[p.category][p.source].append(p)
    return by_cat


def _interleaved(sources: dict[str, list[Prompt]]) -> list[Prompt]:
    """A category's prompts, its source categories taking turns (the order ``select`` picks in)."""
    queues = list(sources.values())
    return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]


def select_next(
    prompts: Sequence[Prompt],
    categories: Sequence[str],
    taken: Sequence[Prompt],
    n: int,
    fits: Callable[[Prompt], bool] = lambda p: True,
) -> list[Prompt]:
    """The next ``n`` fitting prompts of each category after ``taken`` (what ``select`` chose), in
    the same order: prompts outside the measured set, e.g. to tune a peer's options on."""
    by_cat, seen = _by_category(prompts), {p.qid for p in taken}
    out: list[Prompt] = []
    for cat in categories:
        out += list(islice((p for p in _interleaved(by_cat.get(cat) or {"": []}) if p.qid not in seen and fits(p)), n))
    return out


# ---------------------------------------------------------------------------------- genai's n-gram option
NGRAM_SIZES = (2, 16)  # what genai's GeneratorParams.set_speculative_options accepts (0.18: checked by it)
MAX_DRAFT_TOKENS = (1, 16)


def parse_ngram(value: str | Sequence[int]) -> tuple[int, int]:
    """``"N,K"`` (or a pair) as (ngram_size, max_draft_tokens), checked against what genai 0.18 accepts."""
    try:
        n, k = (int(v) for v in (value.split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        raise BenchError(f"--genai-ngram takes NGRAM_SIZE,MAX_DRAFT_TOKENS, e.g. 3,8 (got {value!r})") from None
    if not (NGRAM_SIZES[0] <= n <= NGRAM_SIZES[1] and MAX_DRAFT_TOKENS[0] <= k <= MAX_DRAFT_TOKENS[1]):
        raise BenchError(
            f"--genai-ngram {n},{k}: genai takes ngram_size {NGRAM_SIZES[0]}..{NGRAM_SIZES[1]} and "
            f"max_draft_tokens {MAX_DRAFT_TOKENS[0]}..{MAX_DRAFT_TOKENS[1]}"
        )
    return n, k


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _template(model) -> str | None:
    if model.tokenizer is None:
        raise BenchError(f"{model.folder.name} has no tokenizer: the benchmark sends text")
    return model.tokenizer.template


def as_prompt(model, messages: Sequence[dict]) -> list[dict] | str:
    """What a run sends for a conversation: its chat messages, or, for a base model without a chat
    template (Gemma-3-270M's GGUF), its turns and answers as plain text separated by blank lines;
    every method and every peer gets the same prompt (a peer its ids)."""
    if _template(model) is None:
        return "\n\n".join(str(m["content"]) for m in messages if m["content"])
    return list(messages)


def prompt_format(model) -> str:
    """How the run's prompts were sent (results.json records it)."""
    return "text (the model has no chat template)" if _template(model) is None else "chat"
