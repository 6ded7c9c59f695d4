"""The quality gate: teacher-forced top-1 agreement with the fp32 export and mean KL(fp32 ||
variant) over a fixed text set (quality_texts.py: 32 Spec-Bench texts, fp32's 64-token greedy
continuations, every position scored), against floors; the same scoring serves inspect --quality
and the bench's peer score."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from ..precisions import INT4
from ..runtime.tree import causal_inputs
from ..schema import TOKENIZER_FILE, split_variant
from .runner import Runner


class SavedSet(Protocol):
    """What ``scoring_set`` reads of a build's torch reference (references.Reference, which imports
    this module): the quality set saved with it, if any."""

    quality: QualitySet | None


# The quality floor of each precision (top-1 agreement with the fp32 export over the quality set,
# 32 texts x 64 tokens) is its entry in precisions.PRECISIONS (precisions.quality_floors()); a
# default must also meet the precision's default floors (pipeline.keeps_answers).
QUALITY_TOKENS = 64  # fp32 greedy continuation per text, every position scored
QUALITY_PROMPT_TOKENS = 128  # each text cut to this many tokens


@dataclass
class QualitySet:
    """Token ids of the fixed texts and fp32's greedy continuation of each (what is scored)."""

    prompts: list[np.ndarray]
    continuations: list[np.ndarray]
    source: str

    @property
    def positions(self) -> int:
        return int(sum(len(c) for c in self.continuations))

    def fit(self, limit: int) -> "QualitySet":
        """The set cut to sequences of at most ``limit`` positions (a small static buffer, a short
        model): prompts lose their first tokens, then continuations their last. Teacher forcing
        compares variant and fp32 on the same tokens, so the cut texts still measure agreement."""
        if all(len(p) + len(c) - 1 <= limit for p, c in zip(self.prompts, self.continuations)):
            return self
        conts = [c[: max(limit - 1, 1)] for c in self.continuations]
        prompts = [p[-max(limit - len(c) + 1, 1) :] for p, c in zip(self.prompts, conts)]
        return QualitySet(prompts, conts, f"{self.source}, cut to {limit} positions")

    def digest(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for p, c in zip(self.prompts, self.continuations):
            h.update(np.asarray(p, np.int64).tobytes() + b"|" + np.asarray(c, np.int64).tobytes() + b"\n")
        return h.hexdigest()[:16]


def quality_prompts(folder: Path, vocab: int, n: int | None = None) -> tuple[list[np.ndarray], str]:
    """The quality texts as token ids (the build's own tokenizer.json; a model without one gets
    fixed random ids), each cut to QUALITY_PROMPT_TOKENS."""
    from .quality_texts import TEXTS

    texts = TEXTS[:n] if n else TEXTS
    tok_file = Path(folder) / TOKENIZER_FILE
    if tok_file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
        ids = [tok.encode(t, add_special_tokens=False).ids[:QUALITY_PROMPT_TOKENS] for _, _, t in texts]
        source = f"spec-bench x{len(texts)} (quality_texts.py)"
    else:
        ids = [list(np.random.default_rng(q).integers(3, vocab, QUALITY_PROMPT_TOKENS)) for q, _, _ in texts]
        source = f"random ids x{len(texts)} (no tokenizer.json)"
    return [np.array(i or [1], dtype=np.int64) for i in ids], source


def quality_set(fp32: Runner, prompts: list[np.ndarray], source: str, tokens: int = QUALITY_TOKENS) -> QualitySet:
    """fp32's greedy continuation of each prompt (one prefill, then single steps over the KV cache)."""
    conts = []
    for p in prompts:
        lg, _, past = fp32.prefill(p)
        out = [int(lg[-1].argmax())]
        for _ in range(tokens - 1):
            pos, bias = causal_inputs(1, len(p) + len(out) - 1)
            lg, _, past = fp32.forward(np.array(out[-1:]), pos, bias, past)
            out.append(int(lg[-1].argmax()))
        conts.append(np.array(out, dtype=np.int64))
    return QualitySet(prompts, conts, source)


def scoring_set(folder: Path, fp32: Runner, ref: SavedSet | None, limit: int | None = None) -> QualitySet:
    """What the quality gate scores for the build in ``folder``: the set saved with its torch
    reference, else fp32's own continuations of the quality texts; cut to ``limit`` positions.
    The build's gate and the bench's peer score (bench.peer.peer_quality) read it from here."""
    qs = (ref.quality if ref is not None else None) or quality_set(fp32, *quality_prompts(folder, fp32.c.vocab_size))
    return qs.fit(limit) if limit else qs


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


# fp32's scored logits are kept between gate_quality calls (FP32Logits) up to this many bytes
FP32_LOGITS_BYTES = 1 << 30


class FP32Logits:
    """fp32's logits at the scored positions of a quality set, kept across the build's quality
    passes (the int4 tier's, each kept trial's, the prefill graphs'): each pass ran fp32 over the
    whole set again (SmolLM2: ~5.5 s of prefills and ~1.5 s of softmax per pass). The same float32
    logits either way, so every gate's figures are unchanged; a set larger than FP32_LOGITS_BYTES
    (a 262k vocabulary) is recomputed per pass instead of held."""

    def __init__(self) -> None:
        self._set: str | None = None
        self._positions = 0
        self._rows: list[np.ndarray] = []

    def use(self, qs: QualitySet) -> None:
        """The set the next get() calls score (once per pass: what was kept of another set goes)."""
        digest = qs.digest()
        if self._set != digest:
            self._set, self._positions, self._rows = digest, qs.positions, []

    def get(self, fp32: Runner, i: int, seq: np.ndarray, sl: slice) -> np.ndarray:
        """fp32's logits at text ``i``'s scored positions ``sl`` of ``seq`` (texts in order)."""
        if i < len(self._rows):
            return self._rows[i]
        logits = np.ascontiguousarray(fp32.prefill(seq)[0][sl])
        if i == len(self._rows) and self._positions * logits.shape[-1] * logits.itemsize <= FP32_LOGITS_BYTES:
            self._rows.append(logits)
        return logits


def gate_quality(
    fp32: Runner,
    runners: dict[str, Runner],
    qs: QualitySet,
    floors: dict[str, float],
    fp32_logits: FP32Logits | None = None,
) -> dict[str, dict]:
    """Teacher-forced over the quality set: each variant's top-1 agreement with the fp32 export and
    the mean KL(fp32 || variant) of the next-token distributions, at every continuation position.
    Text by text; ``fp32_logits`` keeps fp32's logits for the next call (FP32Logits), else they
    are computed here and never all held."""
    agree = dict.fromkeys(runners, 0)
    kl = dict.fromkeys(runners, 0.0)
    if fp32_logits is not None:
        fp32_logits.use(qs)
    for i, (p, c) in enumerate(zip(qs.prompts, qs.continuations)):
        seq = np.concatenate([p, c[:-1]])
        sl = slice(len(p) - 1, len(seq))
        ref = _log_softmax(fp32_logits.get(fp32, i, seq, sl) if fp32_logits else fp32.prefill(seq)[0][sl])
        top = ref.argmax(-1)
        pref = np.exp(ref)
        for name, r in runners.items():
            lq = _log_softmax(r.prefill(seq)[0][sl])
            agree[name] += int((lq.argmax(-1) == top).sum())
            kl[name] += float((pref * (ref - lq)).sum())
    n = qs.positions
    out = {}
    for name in runners:
        precision = split_variant(name)[0]
        floor = floors.get(precision, floors.get(INT4, 0.0))
        rate = agree[name] / max(n, 1)
        out[name] = {
            "passed": bool(rate >= floor),
            "top1": round(rate, 4),
            "agree": agree[name],
            "positions": n,
            "mean_kl": round(kl[name] / max(n, 1), 5),
            "floor": floor,
            "texts": len(qs.prompts),
            "set": qs.source,
            "set_sha256": qs.digest(),
        }
    return out
