"""Later tiers as timed trials: the auto build gates int4 (tier 1) in every layout; int4op (tier 2:
the same blocks in our own operator, where it compiles) and int8 (tier 3: 8-bit blocks, no offset
term) keep the answers as well but run other kernels, each faster or slower than the exact int4
carry by CPU (AVX-512 + AMX Xeon: 8-bit MatMulNBits cost 1.53x the 4-bit ones at one row; AMD EPYC
AVX-512 VNNI: int8-static 0.83x and int4op-static 0.64-0.73x int4-static's step, docs/speed.md).
Building, gating and keeping them everywhere would add ~40% each to the build and break the entry's
size budget, so the build quantizes each, writes its flavour in the layout of int4's preferred
candidate, and times it interleaved against that candidate -- or against the last trial kept,
which a faster one replaces (at most one trial flavour stays) -- through the runtime's own
Decoder. A trial variant stays (gated like every variant, a candidate the picker then times) only
where it is clearly faster by the picker's rule; otherwise its files go and the manifest says what
was measured (``default_reason["trials"]``). Its concat base (the file the flavour was derived
from) goes either way: it is no faster than the flavour and 100-150 MB on SmolLM2, and quant-only
derives it again from the fp32 export when asked."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from .. import precisions as P
from .. import schema as S
from ..layouts import capacity
from ..log import logger, step
from ..runtime.session import make_session
from ..schema import variant_file
from .default import MIN_ROUNDS, candidates, clearly_faster, preference, ratio_record, settled
from .row_guard import guard_variant
from .timing import time_interleaved
from .validation import Gating, quality, validate
from .variants import Quantized, layout_variant, operators_missing, quantize

TRIAL_ROUNDS = 5  # interleaved rounds at most (each times 1 and 8 rows at pasts 256 and 1024; default.settled)


def trial_tiers(g: Gating, done: Quantized, built: list[str]) -> dict[str, dict]:
    """Try each auto-tier precision not built yet against the preferred candidate; returns the
    record per trial variant (kept or not, and the timings it was judged on)."""
    manifest, folder = g.manifest, g.folder
    cands, _, _ = candidates(manifest)
    if not cands:
        return {}
    first = min(cands, key=preference(manifest, cands))
    layout = S.split_variant(first)[1]
    cap = capacity(manifest.build_config.get("max_context"), g.contract.max_positions)
    trials: dict[str, dict] = {}
    kept: str | None = None  # the last trial kept: a later one is judged against it and replaces it
    for precision in (p for tier in P.auto_tiers() for p in tier if p not in built):
        name = S.variant_name(precision, layout)
        missing = operators_missing(precision)
        if missing:
            logger.info("  no %s trial: %s", name, missing)
            trials[name] = {"against": kept or first, "kept": False, "skipped": missing}
            continue
        quantize(folder, manifest, [precision], done)
        if layout != S.KV_CONCAT and not layout_variant(folder, manifest, precision, cap, layout):
            _drop(g, done, precision, name)
            continue
        guard_variant(folder, manifest, name, g.contract, g.threads)
        against = kept or first
        rec: dict[str, Any] = {"against": against, "kept": False}
        trials[name] = rec
        with step(f"trial of {name} against {against} (kept only if faster), interleaved"):
            own = (
                make_session(folder / variant_file(name), threads=g.threads),
                S.variant_contract(g.contract, manifest.variants[name]),
            )
            # the preferred candidate's session, or the kept trial's (validate opened it)
            timed = time_interleaved(
                {against: g.sessions[against], name: own},
                rounds=TRIAL_ROUNDS,
                min_rounds=MIN_ROUNDS,
                settled=partial(settled, first=against),
            )
        mine, theirs = timed[name]["round_costs_ms"], timed[against]["round_costs_ms"]
        rec["round_costs_ms"] = {against: theirs, name: mine}
        rec["ratio"] = round(float(np.median(mine)) / float(np.median(theirs)), 3)
        rec["cost_ratio"] = ratio_record(mine, theirs)
        rec["kept"] = clearly_faster(mine, theirs)
        logger.info(
            "  %s: %.3fx +- %.3f the step cost of %s (median ratio of %d interleaved rounds): %s",
            name,
            rec["cost_ratio"]["median"],
            rec["cost_ratio"]["error"],
            against,
            len(mine),
            "clearly faster: gated and kept as a candidate"
            if rec["kept"]
            else "not clearly faster (the picker's rule, build.default.clearly_faster): not kept",
        )
        if name != precision:  # the concat base: the flavour is what was timed (and stays if kept)
            _drop(g, done, precision, quantized=rec["kept"])
        if rec["kept"]:
            validate(g, name, fresh=True)
            quality(g, [name])
            if kept is not None:  # slower than this one and kept only as a candidate: it goes
                logger.info("  %s replaces the trial %s (slower): %s goes", name, kept, kept)
                trials[kept]["kept"], trials[kept]["superseded_by"] = False, name
                _drop(g, done, kept, S.split_variant(kept)[0])
            kept = name
        else:
            _drop(g, done, name)
    return trials


def _drop(g: Gating, done: Quantized, *variants: str, quantized: bool = False) -> None:
    """Remove trial variants' files and records (nothing of them stays in the entry);
    ``quantized``: the precision stays in Manifest.quantize (a kept flavour of it stays)."""
    for v in variants:
        g.sessions.pop(v, None)
        g.manifest.variants.pop(v, None)
        for f in (g.folder / variant_file(v), g.folder / (variant_file(v) + ".data")):
            f.unlink(missing_ok=True)
        if v in done.variants and not quantized:
            done.variants.remove(v)
    g.manifest.quantize = {"seconds": round(done.seconds, 1), "variants": list(done.variants)}
