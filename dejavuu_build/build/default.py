"""Choosing the default variant: which variants may be it (quality first: keeps_answers), their
order before timing (smallest precision, then the layouts' preference: layouts.PREFERRED_LAYOUTS),
and the rule by which timing displaces the preferred one (clearly_faster)."""

from __future__ import annotations

import math

import numpy as np

from .. import precisions as P
from .. import schema as S
from ..layouts import LAYOUTS, PREFERRED_LAYOUTS
from ..schema import Manifest, VariantRecord

# A faster variant displaces the preferred (smallest) one only when its median cost ratio over the
# interleaved rounds stays below 1 - MIN_SPEEDUP (closer is a tie: the smaller file stays) by
# NOISE_SIGMAS standard errors of that median (ratio_noise), over at least MIN_ROUNDS rounds.
MIN_SPEEDUP = 0.03
NOISE_SIGMAS = 2.0
MIN_ROUNDS = 3
# what an untimed choose_default carries from the timed reason it keeps
TIMED_REASON = (
    "noise",
    "margin",
    "sigmas",
    "rounds",
    "median_cost_ms",
    "cost_ratio",
    "clearly_faster",
    "timed",
)  # (the trial record is carried by pipeline._settle, timed or not)
IN_PLACE_ORDER = tuple(k for k in PREFERRED_LAYOUTS if LAYOUTS[k].in_place)  # the rule's words


def ratio_noise(mine: list[float], theirs: list[float]) -> tuple[float, float]:
    """(median, robust standard deviation = 1.4826 x MAD) of the per-round cost ratios mine/theirs.

    Why ratios: the rounds are interleaved, so load that slows a round slows both variants and
    cancels in their ratio; the spread of raw costs does not cancel it (measured 2026-12-06 on a
    shared 2-core AMD EPYC: one slow round put the raw spread at 31% while the ratio's was 2%)."""
    r = np.asarray(mine, dtype=np.float64) / np.asarray(theirs, dtype=np.float64)
    med = float(np.median(r))
    return med, 1.4826 * float(np.median(np.abs(r - med)))


def median_error(sd: float, rounds: int) -> float:
    """The standard error of a median of ``rounds`` ratios with robust sd ``sd`` (sqrt(pi/2) x
    sd / sqrt(n)): how far the measured median may sit from the true ratio."""
    return math.sqrt(math.pi / 2) * sd / math.sqrt(max(rounds, 1))


def ratio_record(mine: list[float], theirs: list[float]) -> dict[str, float]:
    """The manifest's record of a cost ratio: median, robust sd and the median's standard error."""
    med, sd = ratio_noise(mine, theirs)
    return {"median": round(med, 4), "sd": round(sd, 4), "error": round(median_error(sd, len(mine)), 4)}


def clearly_faster(mine: list[float], theirs: list[float]) -> bool:
    """The picker's rule (and build.trial's): over at least MIN_ROUNDS interleaved rounds, the
    median cost ratio plus NOISE_SIGMAS standard errors of it is below 1 - MIN_SPEEDUP.

    Why the median's error and not the rounds' spread (the rule until 2026-12-06, with a 10%
    margin and every round faster): the question is whether the variant is faster, not whether
    each round says so. Measured on a shared AMD EPYC (AVX-512 VNNI): int8-static cost 0.92x
    int4-static (robust sd 0.01-0.04 over 5 rounds) and decoded Spec-Bench prompts 1.15x faster
    (plain) and 1.13x (auto) in one interleaved run, yet the old rule kept int4-static."""
    if len(mine) < MIN_ROUNDS or len(mine) != len(theirs):
        return False
    med, sd = ratio_noise(mine, theirs)
    return med + NOISE_SIGMAS * median_error(sd, len(mine)) < 1 - MIN_SPEEDUP


def keeps_answers(variant: str, rec: VariantRecord) -> bool:
    """The variant's quality gate meets its precision's default floors (precisions.Precision:
    default_top1, default_mean_kl): what a default must keep of the model, whatever its size or
    speed; one under them passes its own gate and can be asked for, but is not the default. fp32,
    the reference, has no quality gate: it does."""
    q = rec.gates.get("quality")
    p = P.PRECISIONS.get(S.split_variant(variant)[0])
    top1, kl = (p.default_top1, p.default_mean_kl) if p else (P.DEFAULT_TOP1, P.DEFAULT_MEAN_KL)
    return q is None or (q["top1"] >= top1 and q["mean_kl"] <= kl)


def default_floors_line() -> str:
    """The default floors as the default's rule states them: one pair when every quantized
    precision has the same (today's table), else each precision's."""
    quantized = [p for p in P.PRECISIONS.values() if not p.reference]
    pairs = {(p.default_top1, p.default_mean_kl) for p in quantized}
    if len(pairs) == 1:
        top1, kl = pairs.pop()
        return f"top-1 >= {top1}, mean KL <= {kl}"
    return "; ".join(f"{p.name}: top-1 >= {p.default_top1}, mean KL <= {p.default_mean_kl}" for p in quantized)


def candidates(manifest: Manifest) -> tuple[dict[str, VariantRecord], list[str], dict[str, str]]:
    """What the default is chosen among (and so what is timed), the passing variants that keep the
    model's answers, and why each other variant is not a candidate. Quality first: only variants
    that passed every gate, and of those the ones that keep the model's answers (keeps_answers;
    all passing ones if none does). fp32 (the reference, several times the size of a quantized
    file) is a candidate only where no quantized variant keeps the answers."""
    why: dict[str, str] = {}
    passing = {n: r for n, r in manifest.variants.items() if r.passed}
    for n in manifest.variants:
        if n not in passing:
            why[n] = "failed its gates"
    below = [n for n, r in passing.items() if not keeps_answers(n, r)]
    keep = {n: r for n, r in passing.items() if n not in below} or passing
    if keep is not passing:
        why.update(dict.fromkeys(below, "under the default floors"))
    cands = keep
    if any(S.split_variant(n)[0] != S.FP32 for n in keep):
        cands = {n: r for n, r in keep.items() if S.split_variant(n)[0] != S.FP32}
        why.update(
            dict.fromkeys(
                (n for n in keep if n not in cands), "the fp32 reference: a quantized variant keeps the answers"
            )
        )
    return cands, sorted(keep), why


def preference(manifest: Manifest, cands: dict[str, VariantRecord]):
    """The candidates' order before timing: smallest precision, then the layouts' preference
    (layouts.PREFERRED_LAYOUTS: static, rowwise, concat)."""

    def pref(n: str):
        precision, layout = S.split_variant(n)
        size = (manifest.variants.get(precision) or cands[n]).bytes or 0
        return (size, PREFERRED_LAYOUTS.index(layout), n)

    return pref


def settled(per_round: dict[str, list[float]], first: str) -> bool:
    """Further timing rounds would not change the default (a build-time saving, not the rule
    itself): every other candidate's median cost ratio to ``first`` over the rounds so far is at
    least 1 - MIN_SPEEDUP (a tie or slower: none is on its way to being clearly faster); or one
    is clearly faster than ``first`` already and every other candidate's median ratio to that one
    is at least 1 + MIN_SPEEDUP, so no other can become the fastest of the clearly faster (the
    SmolLM2 build on an AVX2 EPYC: int4op-static at 0.60x int4-static, the int4 layouts at
    1.6-1.9x it, decided after 3 of 5 rounds). A speed trial (build.trial: two candidates, from
    MIN_ROUNDS rounds on) stops by it too: clearly faster, or a tie or slower."""
    base = per_round.get(first, [])
    others = {n: x for n, x in per_round.items() if n != first and len(x) == len(base)}
    if all(ratio_noise(x, base)[0] >= 1 - MIN_SPEEDUP for x in others.values()):
        return True
    faster = [n for n, x in others.items() if clearly_faster(x, base)]
    if not faster:
        return False
    lead = min(faster, key=lambda n: float(np.median(others[n])))
    return all(ratio_noise(x, others[lead])[0] >= 1 + MIN_SPEEDUP for n, x in others.items() if n != lead)


def choose_default(manifest: Manifest) -> tuple[str | None, dict]:
    """The default variant and why, among the candidates (candidates: passing, keeping the
    answers, quantized before fp32). The smallest precision, in the layouts' preference
    (layouts.PREFERRED_LAYOUTS) -- what a user keeps. A larger one replaces it only where
    interleaved timing shows it clearly faster (clearly_faster: the median cost ratio below
    1 - MIN_SPEEDUP by NOISE_SIGMAS standard errors), so load cannot flip the choice. Untimed
    (--no-timing): the default an earlier timing of this entry chose, while still a candidate
    (quant-only --no-timing measures nothing that could overturn it), else that preferred
    candidate, the same starting point, with nothing to displace it."""
    if not any(r.passed for r in manifest.variants.values()):
        return None, {"rule": "no variant passed its gates"}
    passing, keep, not_candidates = candidates(manifest)
    below = sorted(n for n, r in manifest.variants.items() if r.passed and not keeps_answers(n, r))
    pref = preference(manifest, passing)
    first = min(passing, key=pref)
    why: dict = {
        "rule": f"passing variants that keep the model's answers ({default_floors_line()} against fp32), quantized "
        f"before the fp32 reference, smallest precision and in-place layout ({', then '.join(IN_PLACE_ORDER)}) "
        f"preferred; a larger one only if its median cost ratio over at least {MIN_ROUNDS} interleaved rounds is "
        f"below {1 - MIN_SPEEDUP:g} by {NOISE_SIGMAS:g} standard errors of that median",
        "preferred": first,
        "passing": keep,
        "candidates": sorted(passing),
        "not_candidates": dict(sorted(not_candidates.items())),
        "below_default_floors": below,
    }
    rounds = {n: r.timing_rounds_ms for n, r in passing.items()}
    if not all(rounds.values()) or len({len(x) for x in rounds.values()}) != 1:
        prev, prev_why = manifest.default_variant, manifest.default_reason or {}
        if prev in passing and prev != first and "rounds" in prev_why:
            # chosen by an earlier timing on this entry (its figures kept): nothing measured since
            why.update({k: prev_why[k] for k in TIMED_REASON if k in prev_why})
            why.update(
                timing=f"not timed: {prev}, the default an earlier timing of this entry chose, still a candidate"
            )
            return prev, why
        # the timed rule's starting point, so an untimed build (every test's) gets the default a
        # timed one keeps unless something is clearly faster -- not the smallest file (rowwise)
        why.update(timing="not timed: the preferred candidate (smallest precision, then the layouts' preference)")
        return first, why
    others = [n for n in passing if n != first]
    ratios = {n: ratio_record(rounds[n], rounds[first]) for n in sorted(others)}
    faster = [n for n in others if clearly_faster(rounds[n], rounds[first])]
    pick = min(faster, key=lambda n: (float(np.median(rounds[n])), pref(n))) if faster else first
    why.update(
        noise=max((r["sd"] for r in ratios.values()), default=0.0),  # the largest ratio sd
        margin=MIN_SPEEDUP,
        sigmas=NOISE_SIGMAS,
        rounds=len(rounds[first]),
        median_cost_ms={n: round(float(np.median(x)), 3) for n, x in rounds.items()},
        cost_ratio=ratios,
        clearly_faster=sorted(faster),
    )
    return pick, why


def pick_default(manifest: Manifest) -> str | None:
    return choose_default(manifest)[0]
