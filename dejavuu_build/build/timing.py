"""Forward timings of several variants, interleaved (what the default is picked by): every round
times every variant at 1, 2 and 8 new rows over pasts of 256 and 1024, through the runtime's own
Decoder, so load that comes and goes hits them all alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .. import schema as S
from ..log import logger, step
from ..schema import Contract, Manifest, in_place

TIMING_KEYS = ("n2_p256", "n8_p256", "n2_p1024", "n8_p1024")


def timing_keys(dec) -> tuple[str, ...]:
    """What a variant is judged on: a single-token step as the runtime runs it (two rows, or one
    on a rowwise graph) and an 8-row verify, at pasts 256 and 1024."""
    return tuple(k.replace("n2_", "n1_") for k in TIMING_KEYS) if dec.rowwise else TIMING_KEYS


def time_interleaved(
    sessions: dict[str, tuple],
    *,
    rounds: int = 5,
    repeats: int = 6,
    min_rounds: int = 1,
    settled: Callable[[dict[str, list[float]]], bool] | None = None,
) -> dict[str, dict]:
    """Forward timings of several variants, interleaved: every round times every variant at every
    (rows, past) once, fastest of ``repeats``; so load that comes and goes hits them all alike.
    Returns per variant the fastest over all rounds per key (ms) and the per-round cost (mean over
    TIMING_KEYS present) from which the picker reads the noise. ``settled(per_round)``, asked after
    each round from ``min_rounds`` on, stops early when no further round can change what the
    timings decide (the picker's rule: default.settled)."""
    from ..runtime.decoder import Decoder

    rng = np.random.default_rng(0)
    plans = {}
    for name, (session, contract) in sessions.items():
        dec = Decoder(session, contract)
        plans[name] = (dec, _timing_cases(dec, contract, rng))
    for dec, cases in plans.values():  # warm-up: first runs grow arenas and fault pages in
        for _, n, toks, embeds, kv in cases:
            with dec.padding(n != 1):
                dec.forward(toks, None, kv, embeds=embeds)
    best: dict[str, dict[str, float]] = {n: {} for n in sessions}
    per_round: dict[str, list[float]] = {n: [] for n in sessions}
    for done in range(rounds):
        for name, (dec, cases) in plans.items():
            this = {}
            for key, n, toks, embeds, kv in cases:
                this[key] = _fastest_ms(dec, n, toks, embeds, kv, repeats, skip=1)
                best[name][key] = round(min(best[name].get(key, 1e9), this[key]), 3)
            keys = [k for k in timing_keys(dec) if k in this]
            per_round[name].append(round(float(np.mean([this[k] for k in keys])), 3))
        if settled is not None and done + 1 >= min_rounds and settled(per_round):
            break
    for _, cases in plans.values():
        _release(cases)
    return {n: {"timings_ms": best[n], "round_costs_ms": per_round[n]} for n in sessions}


def _timing_cases(dec, contract: Contract, rng) -> list[tuple]:
    """``(key, rows, tokens, embeds, kv)`` for 1, 2 and 8 new rows over a random past of 256 and
    1024 positions (where the decoder holds them); one cache per past, shared by its rows."""
    limit = contract.position_limit
    cases = []
    for past_len in (p for p in (256, 1024) if p + 8 < limit):
        kv = dec.new_cache()
        kv.ensure(past_len + 8)
        if in_place(contract.kv_layout):
            kv.buf[:, :, :, :past_len] = rng.standard_normal(kv.buf[:, :, :, :past_len].shape).astype(np.float32)
        else:
            kv.arrays = {
                k: rng.standard_normal((1, contract.num_kv_heads, past_len, contract.head_dim)).astype(np.float32)
                for k in kv.names
            }
        kv.length = past_len
        for n in (1, 2, 8):
            toks = [int(t) for t in rng.integers(0, contract.vocab_size, n)]
            embeds = (
                rng.standard_normal((1, n, contract.hidden_size)).astype(np.float32)
                if contract.primary_input == "inputs_embeds"
                else None
            )
            cases.append((f"n{n}_p{past_len}", n, toks, embeds, kv))
    return cases


def _fastest_ms(dec, n: int, toks, embeds, kv, repeats: int, skip: int) -> float:
    """Fastest of ``repeats`` forwards after ``skip`` untimed ones; n == 1 times the raw one-row path."""
    ts = []
    with dec.padding(n != 1):
        for i in range(skip + repeats):
            t0 = time.perf_counter()
            dec.forward(toks, None, kv, embeds=embeds)
            if i >= skip:
                ts.append(time.perf_counter() - t0)
    return 1000 * min(ts)


def _release(cases) -> None:
    for kv in {id(c[4]): c[4] for c in cases}.values():
        kv.release()


def time_candidates(manifest: Manifest, sessions: dict[str, tuple]) -> dict[str, dict]:
    """Time the default's candidates interleaved (default.candidates: what timing can choose
    between; rounds stop once no other can displace the preferred one: default.settled) and record
    each one's timings; what this run did not time carries no older figures. The variants timed."""
    from .default import candidates, preference
    from .default import settled as cannot_change

    cands, _, skip = candidates(manifest)
    first = min(cands, key=preference(manifest, cands)) if cands else None
    chosen = {v: s for v, s in sessions.items() if v in cands}
    timed: dict[str, dict] = {}
    if chosen:
        with step(f"time {', '.join(sorted(chosen, key=S.variant_order))}, interleaved"):
            timed = time_interleaved(
                chosen,
                min_rounds=min(len(chosen), 2),
                settled=lambda per_round: cannot_change(per_round, str(first)),
            )
    for v in manifest.variants:
        if v not in timed:  # what this run did not time carries no older figures
            rec = manifest.variants[v]
            rec.timings_ms, rec.timing_rounds_ms, rec.verify_cost_ratio = {}, [], None
    if skip:
        logger.info("  not timed (cannot be the default): %s", "; ".join(f"{v}: {w}" for v, w in sorted(skip.items())))
    for v, t in timed.items():
        rec = manifest.variants[v]
        rec.timings_ms, rec.timing_rounds_ms = t["timings_ms"], t["round_costs_ms"]
        tm = rec.timings_ms
        if "n1_p256" in tm:
            rec.verify_cost_ratio = round(tm["n8_p256"] / tm["n1_p256"], 2)
            tm["pad_cost_ratio"] = round(tm["n2_p256"] / tm["n1_p256"], 2)
    return timed
