"""Validation gates, the way speculative decoding needs them.

(a) fp32 parity with torch: logits and hidden states for a chain (prefill, then a chunk over a
    past) and for a real tree (each node equals its root->node path run as a plain chain by
    transformers itself, with its own causal / sliding-window masks; siblings never see each other).
(b) teacher-forced top-1 agreement with torch fp32's greedy continuation of real prompts.
(c) batched-vs-incremental: N tokens in one forward pick the argmaxes of N single steps.
(d) the serving batch graph: requests side by side in one forward, each bit-identical to alone.
The quality gate (build.quality) and the forward timings (build.timing) have their own modules;
torch computes the references once at export time (build.references, ``reference.npz``), so the
ORT side is torch-free and ``quant-only`` re-validates from the saved references.
"""

from __future__ import annotations

import numpy as np

from ..log import logger
from ..precisions import PRECISIONS
from ..runtime.tree import causal_inputs, step_inputs
from ..schema import Contract
from .references import Reference
from .runner import Runner

# The teacher-forced floor of each precision is its entry in precisions.PRECISIONS.


def _close(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    diff = float(np.abs(a - b).max())
    return diff, 2e-3 + 1e-4 * float(np.abs(b).max())


def gate_parity(r: Runner, ref: Reference) -> dict:
    """(a) chain and tree parity with torch fp32 (logits and hidden states)."""
    ids, split = ref.chain_ids, ref.chain_split
    lg0, hd0, past = r.prefill(ids[:split])
    pos, bias = causal_inputs(len(ids) - split, split)
    lg1, hd1, _ = r.forward(ids[split:], pos, bias, past)
    logits = np.concatenate([lg0, lg1])
    hidden = np.concatenate([hd0, hd1])
    chain_l, tol_l = _close(logits, ref.chain_logits)
    chain_h, tol_h = _close(hidden, ref.chain_hidden)
    pos, bias = step_inputs(list(map(int, ref.tree_parents)), split)
    tl, th, _ = r.forward(ref.tree_tokens, pos, bias, past)
    tree_l, ttol_l = _close(tl, ref.tree_logits)
    tree_h, ttol_h = _close(th, ref.tree_hidden)
    ok = chain_l <= tol_l and chain_h <= tol_h and tree_l <= ttol_l and tree_h <= ttol_h
    return {
        "passed": bool(ok),
        "chain_logits_maxdiff": chain_l,
        "chain_hidden_maxdiff": chain_h,
        "tree_logits_maxdiff": tree_l,
        "tree_hidden_maxdiff": tree_h,
        "tolerance_logits": tol_l,
        "tokens": int(len(ids)),
        "tree_nodes": int(len(ref.tree_tokens)),
    }


def gate_teacher_forced(r: Runner, ref: Reference, floor: float) -> dict:
    """(b) top-1 agreement with torch fp32's greedy continuation, teacher-forced."""
    agree = total = 0
    for p, g in zip(ref.prompts, ref.greedy):
        seq = np.concatenate([p, g[:-1]])
        lg, _, _ = r.prefill(seq)
        pred = lg[len(p) - 1 :].argmax(-1)
        agree += int((pred == g).sum())
        total += len(g)
    rate = agree / max(total, 1)
    return {"passed": bool(rate >= floor), "agree": agree, "total": total, "rate": round(rate, 4), "floor": floor}


BATCH_ROWS = tuple(range(2, 18))  # verify sizes the batched gate checks
BATCH_PASTS = (250, 1018)  # + up to 17 rows: crosses the 256- and 1024-key boundaries


def gate_batched(r: Runner, ref: Reference) -> dict:
    """(c) Every verify size N in 2..17 gives logits BIT-identical (max diff 0.0) to N single steps
    run the way the runtime runs them, over short prompts and over pasts whose new rows cross the
    256- and 1024-key boundaries. That equality is what makes speculative output equal plain
    decoding. ``raw_single_row_maxdiff`` shows why single steps are padded to two rows: the
    one-row kernel path differs in the last bits, and int8 activations amplify it."""
    dec = r.dec  # the runtime's own Decoder on this session
    limit = r.c.position_limit
    n_max = max(BATCH_ROWS)
    stream = np.concatenate([np.concatenate([p, g]) for p, g in zip(ref.prompts, ref.greedy)] + [ref.chain_ids])
    long = np.resize(stream, max(BATCH_PASTS) + n_max)
    cases = [(np.asarray(p), np.asarray(g[:n_max])) for p, g in zip(ref.prompts, ref.greedy)]
    cases += [(long[:past], long[past : past + n_max]) for past in BATCH_PASTS if past + n_max + 1 <= limit]
    mism = total = 0
    maxdiff = rawdiff = 0.0
    for past, chunk in cases:
        kv = dec.new_cache()
        _, _, pres = dec.forward(past.tolist(), None, kv)
        kv.commit(pres, len(past), list(range(len(past))))
        singles = []
        for t in chunk:  # single steps (padded), committed one by one
            li, _, pres = dec.forward([int(t)], None, kv)
            kv.commit(pres, 1, [0])
            singles.append(li[0])
        inc = np.stack(singles)
        kv.truncate(len(past))
        for n in (k for k in BATCH_ROWS if k <= len(chunk)):
            lb, _, _ = dec.forward(chunk[:n].tolist(), None, kv)
            mism += int((lb.argmax(-1) != inc[:n].argmax(-1)).sum())
            total += n
            maxdiff = max(maxdiff, float(np.abs(lb - inc[:n]).max()))
        with dec.padding(False):  # the unpadded one-row path, for the record
            raw, _, _ = dec.forward(chunk[:1].tolist(), None, kv)
        rawdiff = max(rawdiff, float(np.abs(raw[0] - inc[0]).max()))
        kv.release()
    return {
        "passed": mism == 0 and maxdiff == 0.0,
        "mismatches": mism,
        "total": total,
        "logits_maxdiff": maxdiff,
        "rows": [min(BATCH_ROWS), max(BATCH_ROWS)],
        "pasts": [len(p) for p, _ in cases],
        "raw_single_row_maxdiff": rawdiff,
    }


def run_gates(precision: str, session, contract: Contract, ref: Reference, *, embed=None) -> dict:
    """Gates (a)-(c) of one variant of ``precision``: parity (the fp32 reference only), teacher-forced
    top-1 (at the precision's floor), batched = incremental."""
    p = PRECISIONS[precision]
    r = Runner(session, contract, embed)
    gates = {}
    if p.reference:
        gates["parity"] = gate_parity(r, ref)
    gates["teacher_forced"] = gate_teacher_forced(r, ref, p.teacher_forced_floor)
    gates["batched_vs_incremental"] = gate_batched(r, ref)
    res = {"gates": gates, "passed": all(g["passed"] for g in gates.values())}
    for name, g in gates.items():
        logger.debug("  %s %s: %s", precision, name, g)
    return res


def gate_serve_batch(dec, path, threads: int) -> dict:
    """(d) the serving batch graph at ``path`` (export.passes.serve_batch or serve_batch_rowwise,
    made from ``dec``'s static or rowwise graph): several requests side by side in one forward,
    every prefill and step BIT-identical to decoding that request alone (serve.batch.measure_exact
    over GATE_CHECK: pasts whose steps cross 64 and 256 positions, steps of 1 to 8 rows; a rowwise
    request alone runs at its own buffer length, side by side at the batch's). The server
    re-checks it briefly where it runs."""
    from ..serve.batch import GATE_CHECK, batch_decoder, measure_exact

    return measure_exact(dec, batch_decoder(dec, path, len(GATE_CHECK), threads), GATE_CHECK)
