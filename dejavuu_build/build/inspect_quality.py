"""`dejavuu-build inspect --quality`: does a built variant keep the model's answers on texts the
build's gate never saw?

The quality gate scores a fixed set (quality_texts.py: 32 Spec-Bench prompts). A user's question
is about other texts, so this scores any set the same way -- the entry's fp32 export continues
each text greedily (QUALITY_TOKENS), then the variant is teacher-forced on those tokens and
compared position by position: top-1 agreement and mean KL(fp32 || variant) -- by default on
Spec-Bench prompts outside the gate's set, spread evenly over the file.
"""

from __future__ import annotations

from pathlib import Path

from .. import schema as S
from ..errors import CacheError, DejavuuError
from ..log import step
from ..rows import json_row, not_utf8


def held_out_texts(path: Path | None, n: int) -> tuple[list[str], str]:
    """``n`` texts, spread evenly over a .jsonl (Spec-Bench rows, or {"text"|"prompt"}) or a .txt
    (one per line) -- by default Spec-Bench next to the checkout -- leaving out the Spec-Bench
    prompts the quality gate scores (quality_texts.py), each cut at 1,000 characters."""
    from .quality_texts import TEXTS

    if path is None:
        from ..bench.config import default_data_path

        path = default_data_path()
        if path is None:
            raise DejavuuError("no Spec-Bench file found next to the checkout: pass --texts FILE (.jsonl or .txt)")
    path = Path(path)
    if not path.is_file():
        raise DejavuuError(f"--texts {path}: no such file")
    gate = {q for q, _, _ in TEXTS}
    texts = []
    try:
        if path.suffix == ".jsonl":
            for i, ln in enumerate(path.open(encoding="utf-8"), 1):
                if not ln.strip():
                    continue
                try:
                    row = json_row(ln, f"{path}:{i}")
                except ValueError as e:  # not JSON, nested too deeply, a lone surrogate
                    raise DejavuuError(f"{e}: expected a JSON object with turns, text or prompt") from None
                try:
                    if "turns" in row and row.get("question_id") in gate:
                        continue  # scored by the gate already
                    texts.append(str(row["turns"][0] if "turns" in row else row.get("text") or row["prompt"]))
                except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                    raise DejavuuError(f"{path}:{i}: expected a JSON object with turns, text or prompt") from None
        else:
            texts = [ln.strip() for ln in path.open(encoding="utf-8") if ln.strip()]
    except UnicodeDecodeError as e:
        raise DejavuuError(f"--texts {not_utf8(path, e)}") from None
    if not texts:
        raise DejavuuError(f"--texts {path} holds no text outside the quality gate's set")
    every = max(len(texts) // n, 1)
    picked = texts[every // 2 :: every][:n] if every > 1 else texts[:n]
    return [t[:1000] for t in picked], (
        f"{path.name} x{len(picked)} outside the gate's set" + (f" (every {every}th)" if every > 1 else "")
    )


def quality_report(
    target: str, variant: str | None, texts: Path | None, n: int, threads: int
) -> tuple[list[str], dict]:
    """(lines to print, JSON record) for one variant of a built entry against its fp32 export."""
    from tokenizers import Tokenizer

    from ..cache import locate, read_checked_manifest
    from ..runtime.session import make_session
    from .quality import QUALITY_PROMPT_TOKENS, QUALITY_TOKENS, gate_quality, quality_set
    from .runner import Runner

    folder = Path(locate(target))
    if not (folder / S.MANIFEST_FILE).is_file():
        raise CacheError(f"no built entry {target!r}: pass a cache name or an entry folder with a manifest.json")
    manifest = read_checked_manifest(folder)
    if manifest.kind not in S.DECODER_KINDS:
        raise CacheError(
            f"{target} is a {manifest.kind} entry, not a decoder build: pass the cache name of a decoder "
            f"(`dejavuu-build tree-decoder` builds one)"
        )
    v = variant or manifest.default_variant
    if v not in manifest.variants or v == S.FP32:
        raise CacheError(
            f"{target}: pick a quantized variant to score against fp32; it has "
            f"{', '.join(sorted(x for x in manifest.variants if x != S.FP32))}"
        )
    if S.FP32 not in manifest.variants or not (folder / S.TOKENIZER_FILE).is_file():
        raise CacheError(f"{target} lacks its fp32 export or {S.TOKENIZER_FILE}: nothing to score against")
    chosen, source = held_out_texts(texts, n)
    tok = Tokenizer.from_file(str(folder / S.TOKENIZER_FILE))
    import numpy as np

    prompts = [
        np.array(tok.encode(t, add_special_tokens=False).ids[:QUALITY_PROMPT_TOKENS] or [1], dtype=np.int64)
        for t in chosen
    ]
    contract = S.read_contract(folder)
    runners = {}
    for name in (S.FP32, v):
        rec = manifest.variants[name]
        runners[name] = Runner(make_session(folder / rec.file, threads=threads), S.variant_contract(contract, rec))
    with step(f"fp32 greedy continuations of {len(prompts)} texts ({QUALITY_TOKENS} tokens each)"):
        qs = quality_set(runners[S.FP32], prompts, source)
    with step(f"{v} teacher-forced against fp32"):
        g = gate_quality(runners[S.FP32], {v: runners[v]}, qs, {})[v]
    gate = manifest.variants[v].gates.get("quality", {})
    lines = [
        f"{target} {v}: top-1 {g['top1']:.3f} ({g['agree']}/{g['positions']}), mean KL {g['mean_kl']:.4f} "
        f"against fp32 over {source}",
        f"  the build's gate (its own set): top-1 {gate['top1']:.3f}, mean KL {gate['mean_kl']:.4f}"
        if gate
        else "  the build's gate: not measured",
    ]
    g.pop("passed", None)
    g.pop("floor", None)
    return lines, {"entry": str(folder), "variant": v, "held_out": g, "gate": gate}
