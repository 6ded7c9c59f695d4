"""Which (ngram_size, max_draft_tokens) the bench times genai's n-gram speculative decoding with.

genai's n-gram drafting is only as fast as its options suit the text, and options picked on the
measured prompts would be tuned on the very answers they are then timed on; so a small sweep
runs first on the next prompts of each category (never part of the report), each prompt's genai
plain decoding then every config back to back (the config order rotating per prompt), and the
config with the highest geo-mean decode tok/s over genai plain's wins. Every config's tok/s,
ratio, token match with genai plain and acceptance are written to ``genai_ngram_sweep.json``
(and the results' ``peers``); a resumed run reuses that choice, so all its records come from one
config. ``--genai-ngram N,K`` skips the sweep, ``--no-genai-ngram`` the whole peer.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..log import logger, progress
from .config import NGRAM_SWEEP, BenchConfig, BenchError, Prompt, as_prompt, common_prefix, parse_ngram, select_next
from .peer import KINDS, PeerResult
from .report import geomean

if TYPE_CHECKING:
    from ..runtime.model import Model

# small, around what genai's defaults and the measurements span (2..4 × 4..16)
SWEEP_CONFIGS: tuple[tuple[int, int], ...] = ((2, 4), (3, 4), (3, 8), (4, 8), (4, 16))
SWEEP_PER_CATEGORY = 1  # prompts per category, first turn only: a choice, not a measurement
SWEEP_FILE = "genai_ngram_sweep.json"
CHOSEN_BY = "x_genai"  # the geo-mean over the sweep prompts of decode tok/s over genai plain's


def sweep_prompts(
    corpus: Sequence[Prompt],
    cfg: BenchConfig,
    measured: Sequence[Prompt],
    fits: Callable[[Prompt], bool],
    n: int = SWEEP_PER_CATEGORY,
) -> list[Prompt]:
    """The next ``n`` prompts of each category after the measured ones; BenchError when there are none."""
    out = select_next(corpus, cfg.categories, measured, n, fits)
    if not out:
        raise BenchError(
            "no prompt outside the measured set is left to choose genai's n-gram options on: "
            "lower --per-category, or fix them with --genai-ngram N,K (or --no-genai-ngram)"
        )
    return out


def _rate(res) -> float:
    return res.decode_tok_s


class NgramCannotRun(BenchError):
    """genai's n-gram speculation failed on every sweep prompt in every config (Gemma-3: its
    sliding-window KV cache cannot rewind a rejected draft once a long prompt has filled the
    window): the peer is skipped with one line (genai.load_peers), the bench goes on."""


def run_ngram_sweep(
    model: Model,
    genai: Any,  # genai.GenaiPeer (not imported: genai loads this module)
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    configs: Sequence[tuple[int, int]] = SWEEP_CONFIGS,
) -> dict:
    """Each prompt's first turn: genai plain, then every config; the per-config summary and the choice."""
    configs = [parse_ngram(c) for c in configs]
    per_prompt: list[dict] = []
    failed: list[str] = []
    for i, p in enumerate(progress(prompts, "genai n-gram sweep", total=len(prompts))):
        ids = model.encode(as_prompt(model, [{"role": "user", "content": p.turns[0]}]))
        try:
            plain = genai.generate(ids, max_new_tokens)
        except BenchError as e:  # genai plain refuses this prompt: nothing to compare with here
            failed.append(f"{p.qid}: {e}")
            continue
        row = {
            "qid": p.qid,
            "category": p.category,
            "prompt_tokens": len(ids),
            "genai_tokens": len(plain.tokens),
            "genai_decode_tok_s": _rate(plain),
            "configs": {},
        }
        for n, k in configs[i % len(configs) :] + configs[: i % len(configs)]:
            try:
                res = genai.generate(ids, max_new_tokens, speculative=(n, k))
            except BenchError as e:  # recorded; a config that failed on a prompt is not chosen
                row["configs"][f"{n},{k}"] = {"failed": str(e)[:400]}
                failed.append(f"{p.qid} ({n},{k}): {e}")
                continue
            spec = res.speculative or {}
            row["configs"][f"{n},{k}"] = {
                "decode_tok_s": _rate(res),
                "tokens": len(res.tokens),
                "forwards": res.steps,
                "common_prefix": common_prefix(res.tokens, plain.tokens),
                "compared": max(len(res.tokens), len(plain.tokens)),
                "identical": res.tokens == plain.tokens,
                "drafted": int(spec.get("draft_tokens_evaluated", 0)),
                "accepted": int(spec.get("draft_tokens_accepted", 0)),
            }
        per_prompt.append(row)
    # a prompt on which every config failed is left out (the measured run skips the peer there,
    # said per prompt); of the rest, only configs that ran on every prompt are compared and chosen
    per_prompt = [r for r in per_prompt if any("failed" not in c for c in r["configs"].values())]
    configs = [c for c in configs if all("failed" not in r["configs"][f"{c[0]},{c[1]}"] for r in per_prompt)]
    if not per_prompt or not configs:
        raise NgramCannotRun(
            f"onnxruntime-genai's n-gram speculation failed on the sweep prompts ({len(failed)} failures); "
            f"first: {failed[0] if failed else 'no prompt ran'}"[:500]
        )
    results = []
    for n, k in configs:
        got = [(r["genai_decode_tok_s"], r["configs"][f"{n},{k}"]) for r in per_prompt]
        drafted = sum(c["drafted"] for _, c in got)
        forwards = sum(c["forwards"] for _, c in got)
        results.append(
            {
                "ngram_size": n,
                "max_draft_tokens": k,
                "decode_tok_s": statistics.fmean(c["decode_tok_s"] for _, c in got),
                "x_genai": geomean([c["decode_tok_s"] / g for g, c in got if g > 0]),
                "match_pct": 100.0
                * sum(c["common_prefix"] for _, c in got)
                / max(sum(c["compared"] for _, c in got), 1),
                "identical": sum(c["identical"] for _, c in got),
                "prompts": len(got),
                "tokens_per_forward": sum(max(c["tokens"] - 1, 0) for _, c in got) / forwards if forwards else None,
                "acceptance_rate": sum(c["accepted"] for _, c in got) / drafted if drafted else None,
            }
        )
    best = max(results, key=lambda r: r[CHOSEN_BY] or 0.0)
    return {
        "configs": [list(c) for c in configs],
        "prompts": [p.qid for p in prompts],
        "turns": "first",
        "max_new_tokens": max_new_tokens,
        "genai_decode_tok_s": statistics.fmean(r["genai_decode_tok_s"] for r in per_prompt),
        "results": results,
        "chosen": {"ngram_size": best["ngram_size"], "max_draft_tokens": best["max_draft_tokens"]},
        "chosen_by": f"{CHOSEN_BY}: the highest geo-mean over the sweep prompts of decode tok/s over genai plain's",
        "failed": failed,
        "per_prompt": per_prompt,
    }


def ngram_peer(
    model: Model,
    genai: Any,  # genai.GenaiPeer (not imported: genai loads this module)
    cfg: BenchConfig,
    out: Path,
    corpus: Sequence[Prompt],
    measured: Sequence[Prompt],
    fits: Callable[[Prompt], bool],
    resume: bool,
) -> GenaiNgram:
    """The genai-ngram peer with its options: ``--genai-ngram N,K``, the resumed run's choice, or a sweep now."""
    if cfg.genai_ngram != NGRAM_SWEEP:
        return GenaiNgram(genai, parse_ngram(cfg.genai_ngram), "--genai-ngram")
    path = Path(out) / SWEEP_FILE
    if resume and path.is_file():
        rec = json.loads(path.read_text())
        logger.info("genai n-gram options from the resumed run's sweep: %s", rec["chosen"])
    else:
        rec = run_ngram_sweep(model, genai, sweep_prompts(corpus, cfg, measured, fits), cfg.max_new_tokens)
        path.write_text(json.dumps(rec, indent=2) + "\n")
        for r in rec["results"]:
            logger.info(
                "genai n-gram (%d, %2d): %.1f tok/s, %.2fx genai plain, %d/%d identical to it",
                r["ngram_size"],
                r["max_draft_tokens"],
                r["decode_tok_s"],
                r["x_genai"] or 0.0,
                r["identical"],
                r["prompts"],
            )
    chosen = rec["chosen"]
    summary = {k: v for k, v in rec.items() if k != "per_prompt"}
    summary["file"] = SWEEP_FILE
    return GenaiNgram(genai, (chosen["ngram_size"], chosen["max_draft_tokens"]), "sweep", summary)


class GenaiNgram:
    """genai's n-gram speculative decoding: the same model and generator as :class:`GenaiPeer`, one
    (ngram_size, max_draft_tokens), so it is timed as a peer of its own (``genai-ngram``)."""

    name = KINDS["genai"].methods[1]

    def __init__(self, peer: Any, options: tuple[int, int], chosen_by: str, sweep: dict | None = None):
        self.peer = peer
        self.options = parse_ngram(options)
        self.chosen_by = chosen_by
        self.sweep = sweep

    def generate(self, ids: Sequence[int], max_new_tokens: int, *, ignore_eos: bool = False) -> PeerResult:
        return self.peer.generate(ids, max_new_tokens, ignore_eos=ignore_eos, speculative=self.options)

    def quality(self, model_folder: str | Path) -> dict:
        return self.peer.quality(model_folder)  # the same build: the same weights and logits

    def describe(self) -> dict:
        n, k = self.options
        return {
            **self.peer.describe(),
            "speculative": {"ngram_size": n, "max_draft_tokens": k},
            "chosen_by": self.chosen_by,
            "sweep": self.sweep,
        }
