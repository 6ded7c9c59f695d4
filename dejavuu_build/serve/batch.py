"""Verify several requests in one forward, each request's tokens equal to decoding it alone: the
server's entry points to a variant's batched serving graph.

Two layouts have one, each driven by its layout's batch driver (``Layout.batch_driver``, one
interface: acquire / release / forward / commit; ``batch_decoder`` looks it up):
``layouts.rowwise.RowwiseBatch``, the rowwise default's (export.passes.serve_batch_rowwise), and
``layouts.static.StaticBatch``, a static variant's (export.passes.serve_batch). Either feeds each
request exactly the rows its layout's single-request driver feeds it alone, so each row's logits
are bit-identical to decoding that request alone; ``measure_exact`` measures that: the build gates
the graph with it, the server re-checks it briefly on its own machine.

The graph is part of the cache entry: the build writes it for the default variant's layout (the
static twin's where the default is the concat layout), gates it and records it in the manifest
(``Manifest.batched``); ``open_batch`` checks it against the manifest's sha256 like every other
file. `serve` batches only the variant it serves (the default, what `generate` runs): a graph of
another variant would give other bits, so it decodes one request per forward and says so (an
entry built before the rowwise batched graph existed holds the static twin's: rebuild it).
An entry built before the graph existed is served one request per forward, with one line saying
to rebuild it (nothing is written at serve time).

Each request is a runtime.job.Job (the engine's own step machine), so the scheduler can put
many requests' verify rows into one call and still decode each as Engine.generate would. A
prompt is prefilled as Engine.generate prefills it (``BatchDriver.prefill``: the decoder's own
``Decoder.prefill``, then its K/V copied into the request's slot), so its K/V are the engine's by
construction and its lm-head runs on each chunk's last row only.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import schema as S
from ..layouts import BATCHED_LAYOUTS, LAYOUTS, BatchDriver, BatchUnavailable, Rows
from ..log import logger

if TYPE_CHECKING:
    from ..runtime.decoder import Decoder
    from ..runtime.model import Model


def open_batch(model: Model, max_batch: int) -> BatchDriver[Any]:
    """The entry's batched graph of ``model`` (a rowwise or static variant), checked against the
    manifest's sha256 (IntegrityError on drift, as for every file the runtime reads).
    BatchUnavailable, with the reason in one line, where there is none to serve: not an in-place
    variant, an entry built before the build wrote the graph, another variant's graph, or one
    that failed its gate."""
    from ..cache import check_batched_graph, rebuild_hint, verify_entry

    c, m = model.contract, model.manifest
    name = model.folder.name
    if m is not None and not m.batched and any(r.kv_layout in BATCHED_LAYOUTS for r in m.variants.values()):
        raise BatchUnavailable(
            f"{name} holds no batched graph (built before the build wrote one): "
            f"{rebuild_hint(m, name)} to batch requests"
        )
    if m is not None and m.batched.get("variant") and m.batched.get("variant") != model.variant:
        # the server decodes what `generate` decodes: another variant's graph would give another
        # answer (a static graph's attention sums keys in another order than the rowwise one's)
        b = m.batched["variant"]
        older = (
            f" ({name} was built before the build wrote the batched graph of a rowwise default: "
            f"{rebuild_hint(m, name)} to batch {model.variant})"
            if model.variant == m.default_variant and c.kv_layout == S.KV_ROWWISE
            else ""
        )
        raise BatchUnavailable(
            f"{name}'s batched graph is {b}'s, and {model.variant} decodes other bits: serving "
            f"{model.variant} (what `generate` runs) one request per forward; `--variant {b}` batches "
            f"requests (then `generate --variant {b}` gives the server's answers){older}"
        )
    if c.kv_layout not in BATCHED_LAYOUTS or m is None or c.mask_kind != S.MASK_ADDITIVE_4D or c.mask_input is None:
        raise BatchUnavailable(
            f"{model.variant} is not an in-place KV build ({' or '.join(BATCHED_LAYOUTS)}) with a 4D mask: "
            f"batched serving needs one (`dejavuu-build tree-decoder --kv-layouts {S.KV_ROWWISE}`)"
        )
    rec = m.batched
    if rec.get("skipped"):
        raise BatchUnavailable(f"{name} holds no batched graph: {rec['skipped']}")
    if rec.get("variant") != model.variant:
        raise BatchUnavailable(
            f"{name}'s batched graph is {rec.get('variant')}'s, not {model.variant}'s: serve without "
            f"--variant (or with --variant {rec.get('variant')}) to batch requests"
        )
    if rec.get("graph_version") != S.BATCHED_GRAPH_VERSION:
        raise BatchUnavailable(
            f"{name}'s batched graph is of version {rec.get('graph_version')}, this server feeds version "
            f"{S.BATCHED_GRAPH_VERSION}: {rebuild_hint(m, name)} to batch requests"
        )
    if not rec.get("passed"):
        g = rec.get("gate", {})
        raise BatchUnavailable(
            f"{name}'s batched graph failed its gate at build ("
            + (
                g["error"]
                if g.get("error")
                else f"{g.get('mismatches', '?')} of {g.get('steps_checked', '?')} request steps not "
                f"bit-identical to decoding alone"
            )
            + ")"
        )
    src = m.variants.get(rec["variant"])
    if src is None or (rec.get("source_sha256") and rec["source_sha256"] != src.sha256):
        raise BatchUnavailable(
            f"{name}'s batched graph was made from another {rec['variant']} file than the one it holds: "
            f"{rebuild_hint(m, name)} to batch requests"
        )
    # its weights are read from the variant's own file (export.shared_weights): both are checked
    files = [f for f in (rec["file"], rec["file"] + ".data", src.file) if f in m.files]
    now = verify_entry(model.folder, files)
    # the batched file holds no weights (export.shared_weights): a rebuild that changed only the
    # variant's bytes shows in the source's sha256, not in the batched graph's own
    if any(now.batched.get(k) != rec.get(k) for k in ("sha256", "source_sha256")):
        raise BatchUnavailable(f"{name} was rebuilt since {model.variant} was loaded: restart to batch requests")
    threads = model.decoder.s.get_session_options().intra_op_num_threads
    out = batch_decoder(model.decoder, model.folder / rec["file"], max_batch, threads)
    check_batched_graph(out.s.get_inputs(), c, model.folder / rec["file"], rebuild_hint(m, name))
    return out


def batch_decoder(decoder: Decoder, path: Path, max_batch: int, threads: int) -> BatchDriver[Any]:
    """The batched graph at ``path``, made from ``decoder``'s graph, driven by its layout's batch
    driver (layouts.LAYOUTS[kv_layout].batch_driver: layouts.rowwise.RowwiseBatch,
    layouts.static.StaticBatch)."""
    driver = LAYOUTS[decoder.c.kv_layout].batch_driver
    if driver is None:
        raise BatchUnavailable(f"no batched serving for the {decoder.c.kv_layout} KV layout")
    return driver(decoder, path, max_batch, threads)


# What the server checks on its own machine before it batches (a few forwards) and what the build
# gates the graph with: (past, row counts of its steps) per request, side by side in one batch.
START_CHECK = ((11, (1, 3, 5)), (23, (5, 1, 3)))
# the build's gate: pasts whose steps cross 64 and 256 positions, steps of 1 (a lone token) to 8 rows
GATE_CHECK = ((11, (1, 3, 5, 8)), (70, (5, 8, 1, 3)), (250, (3, 1, 8, 5)))


def measure_exact(dec: Decoder, batch: BatchDriver[Any], cases=START_CHECK, seed: int = 0) -> dict:
    """Whether the batched graph's rows equal the single-request decoder's bit for bit here: each
    case is one request (a random prompt of ``past`` tokens, then steps of the given row counts),
    every request prefilled as the server prefills it (BatchDriver.prefill: the decoder's own
    prefill, its K/V then copied into the slot), then their steps side by side in one forward;
    the prefill's last row and every step's logits are compared with ``dec`` decoding that request alone. Cases that do not fit the KV capacity or the batch are left out."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    V = dec.c.vocab_size
    cases = [(p, st) for p, st in cases if p + sum(st) + 2 <= batch.capacity][: batch.max_batch]
    prompts = [rng.integers(0, V, p).tolist() for p, _ in cases]
    want = []
    rooms = [sum(st) + 1 for _, st in cases]
    for p, (_, st), room in zip(prompts, cases, rooms):
        kv = dec.new_cache()
        try:
            for i in range(0, len(p), S.PREFILL_CHUNK):  # as Engine.generate prefills
                part = p[i : i + S.PREFILL_CHUNK]
                lg, _, pr = dec.prefill(part, kv, len(p), room)
                kv.commit(pr, len(part), list(range(len(part))))
            outs = [(p, lg[-1].copy())]
            for n in st:
                toks = rng.integers(0, V, n).tolist()
                lg, _, pr = dec.forward(toks, None, kv)
                kv.commit(pr, n, list(range(n)))
                outs.append((toks, lg.copy()))
            want.append(outs)
        finally:
            kv.release()
    mism = checked = 0
    maxdiff = 0.0

    def compare(b: int, j: int, got: np.ndarray) -> None:
        nonlocal mism, checked, maxdiff
        ref = want[b][j][1]
        checked += 1
        if not np.array_equal(got, ref):
            mism += 1
            d = float(np.abs(got - ref).max()) if got.shape == ref.shape else float("inf")
            maxdiff = max(maxdiff, d)
            logger.debug("batched row mismatch: request %d step %d, max diff %.3g", b, j, d)

    slots = [batch.acquire(None) for _ in prompts]
    try:
        for b, (s, p, room) in enumerate(zip(slots, prompts, rooms)):
            for i in range(0, len(p), S.PREFILL_CHUNK):  # as the scheduler prefills
                part = p[i : i + S.PREFILL_CHUNK]
                lg, _ = batch.prefill(s, Rows(part, None), len(p), room)
                batch.commit(s, len(part), list(range(len(part))))
            compare(b, 0, lg[-1])
        for j in range(1, 1 + max((len(st) for _, st in cases), default=0)):
            rows = [Rows(want[b][j][0], None) for b in range(len(cases))]
            outs = batch.forward(slots[0], rows)
            for b in range(len(cases)):
                compare(b, j, outs[b][0])
                batch.commit(slots[b], len(rows[b].tokens), list(range(len(rows[b].tokens))))
    finally:
        for s in reversed(slots):
            batch.release(s)
    return {
        "passed": bool(cases) and mism == 0,
        "requests": len(cases),
        "pasts": [p for p, _ in cases],
        "steps": [list(st) for _, st in cases],
        "steps_checked": checked,
        "mismatches": mism,
        "logits_maxdiff": maxdiff,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def check_exact(dec: Decoder, batch: BatchDriver[Any]) -> bool:
    """The server's start-up check (START_CHECK): a few forwards on the machine it serves on."""
    return measure_exact(dec, batch, START_CHECK)["passed"]
