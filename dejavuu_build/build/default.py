"""Choosing the default variant: which variants may be it (quality first: keeps_answers), their
order before timing (smallest precision, then the layouts' preference: layouts.PREFERRED_LAYOUTS),
and the rule by which timing displaces the preferred one (MIN_SPEEDUP, every interleaved round)."""

from __future__ import annotations

import numpy as np

from .. import precisions as P
from .. import schema as S
from ..layouts import LAYOUTS, PREFERRED_LAYOUTS
from ..schema import Manifest, VariantRecord

# A faster variant displaces the preferred (smallest) one only when it is faster in EVERY
# interleaved round by more than this, and its median cost ratio stays below 1 - MIN_SPEEDUP by
# NOISE_SIGMAS robust standard deviations of its per-round ratios (ratio_noise).
MIN_SPEEDUP = 0.10
NOISE_SIGMAS = 3.0
IN_PLACE_ORDER = tuple(k for k in PREFERRED_LAYOUTS if LAYOUTS[k].in_place)  # the rule's words


def faster_every_round(mine: list[float], theirs: list[float], margin: float = MIN_SPEEDUP) -> bool:
    """Whether ``mine`` (per-round costs) beat ``theirs`` by more than ``margin`` in every round:
    the one rule by which timing displaces a variant (the picker, build.trial's speed trials)."""
    return all(a < (1 - margin) * b for a, b in zip(mine, theirs))


def ratio_noise(mine: list[float], theirs: list[float]) -> tuple[float, float]:
    """(median, robust standard deviation = 1.4826 x MAD) of the per-round cost ratios mine/theirs.

    Why ratios: the rounds are interleaved, so load that slows a round slows both variants and
    cancels in their ratio; the spread of raw costs does not cancel it. Measured 2026-12-06 on a
    shared 2-core AMD EPYC: one slow round (25.9 ms among 21-23) put the raw spread at 31% and the
    old margin (3 x that) at 94%, while int8-rowwise cost 0.69-0.82x int4-static in every round
    (median 0.70, robust sd 0.02): the picker could displace nothing on such a machine."""
    r = np.asarray(mine, dtype=np.float64) / np.asarray(theirs, dtype=np.float64)
    med = float(np.median(r))
    return med, 1.4826 * float(np.median(np.abs(r - med)))


def clearly_faster(mine: list[float], theirs: list[float]) -> bool:
    """The picker's rule: faster in every interleaved round by more than MIN_SPEEDUP, and the
    median ratio below 1 - MIN_SPEEDUP by NOISE_SIGMAS robust standard deviations of the ratios."""
    med, sd = ratio_noise(mine, theirs)
    return faster_every_round(mine, theirs) and med + NOISE_SIGMAS * sd < 1 - MIN_SPEEDUP


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
    """No further timing round can change the default: every other candidate was already, in some
    round, not faster than ``first`` by MIN_SPEEDUP (the least margin the picker ever asks for, in
    every round), so it can never be 'clearly faster' whatever later rounds measure."""
    base = per_round.get(first, [])
    return all(any(a >= (1 - MIN_SPEEDUP) * b for a, b in zip(x, base)) for n, x in per_round.items() if n != first)


def choose_default(manifest: Manifest) -> tuple[str | None, dict]:
    """The default variant and why, among the candidates (candidates: passing, keeping the
    answers, quantized before fp32). The smallest precision, in the layouts' preference
    (layouts.PREFERRED_LAYOUTS) -- what a user keeps. A larger one replaces it only where interleaved timing shows it faster in
    every round by more than MIN_SPEEDUP with a median cost ratio NOISE_SIGMAS robust standard
    deviations below 1 - MIN_SPEEDUP (clearly_faster), so load cannot flip the choice. Untimed
    (--no-timing): that preferred candidate, the same starting point, with nothing to displace it."""
    if not any(r.passed for r in manifest.variants.values()):
        return None, {"rule": "no variant passed its gates"}
    passing, keep, not_candidates = candidates(manifest)
    below = sorted(n for n, r in manifest.variants.items() if r.passed and not keeps_answers(n, r))
    pref = preference(manifest, passing)
    first = min(passing, key=pref)
    why: dict = {
        "rule": f"passing variants that keep the model's answers ({default_floors_line()} against fp32), quantized "
        f"before the fp32 reference, smallest precision and in-place layout ({', then '.join(IN_PLACE_ORDER)}) "
        f"preferred; a larger one only if faster in every interleaved round by more than {MIN_SPEEDUP:.0%}, its median "
        f"cost ratio {NOISE_SIGMAS:g} robust standard deviations of its per-round ratios below {1 - MIN_SPEEDUP:g}",
        "preferred": first,
        "passing": keep,
        "candidates": sorted(passing),
        "not_candidates": dict(sorted(not_candidates.items())),
        "below_default_floors": below,
    }
    rounds = {n: r.timing_rounds_ms for n, r in passing.items()}
    if not all(rounds.values()) or len({len(x) for x in rounds.values()}) != 1:
        # the timed rule's starting point, so an untimed build (every test's) gets the default a
        # timed one keeps unless something is clearly faster -- not the smallest file (rowwise)
        why.update(timing="not timed: the preferred candidate (smallest precision, then the layouts' preference)")
        return first, why
    others = [n for n in passing if n != first]
    ratios = {n: ratio_noise(rounds[n], rounds[first]) for n in others}
    faster = [n for n in others if clearly_faster(rounds[n], rounds[first])]
    pick = min(faster, key=lambda n: (float(np.median(rounds[n])), pref(n))) if faster else first
    why.update(
        noise=round(max((sd for _, sd in ratios.values()), default=0.0), 4),  # the largest ratio sd
        margin=MIN_SPEEDUP,
        rounds=len(rounds[first]),
        median_cost_ms={n: round(float(np.median(x)), 3) for n, x in rounds.items()},
        cost_ratio={n: {"median": round(m, 4), "sd": round(sd, 4)} for n, (m, sd) in sorted(ratios.items())},
        clearly_faster=sorted(faster),
    )
    return pick, why


def pick_default(manifest: Manifest) -> str | None:
    return choose_default(manifest)[0]
