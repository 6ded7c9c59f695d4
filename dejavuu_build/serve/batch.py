"""Verify several requests in one forward, each request's tokens equal to decoding it alone.

Two layouts have a batched serving graph, each driven by its own class with one interface
(acquire / release / forward / commit; ``batch_decoder`` picks it):

- ``RowwiseBatchDecoder``, the rowwise default's (export.passes.serve_batch_rowwise): a batch of B
  requests, each one row of every ``[B, KV, L, D]`` buffer with its own write index, its rows
  right-padded to the step's longest. The rowwise graph runs every row on one-row kernels, so a
  request is fed exactly what the rowwise Decoder feeds it alone (a lone token is one row) and
  its pad rows write past its length, where nothing real looks.
- ``BatchDecoder``, a static variant's (export.passes.serve_batch): one KV buffer row per active
  request, all rows in one array ``[2 * layers, max_batch, kv_heads, capacity, head_dim]``. A step
  feeds each request's rows right-padded to the longest (``query_seqlens``), exactly the rows the
  single-request decoder would feed it — a one-token step becomes two rows, a tree's tokens sit
  at their period-aligned attention slots (pad slots read the root row and exist in attention
  only) — so each row's logits are bit-identical to decoding that request alone (rows are
  independent for any row count >= 2).

Either way the active requests' rows are a contiguous prefix of the slots, bound in place, and
``measure_exact`` measures that each request's rows are bit-identical to decoding it alone: the
build gates the graph with it, the server re-checks it briefly on its own machine.

The graph is part of the cache entry: the build writes it for the default variant's layout (the
static twin's where the default is the concat layout), gates it and records it in the manifest
(``Manifest.batched``); ``open_batch`` checks it against the manifest's sha256 like every other
file. `serve` batches only the variant it serves (the default, what `generate` runs): a graph of
another variant would give other bits, so it decodes one request per forward and says so (an
entry built before the rowwise batched graph existed holds the static twin's: rebuild it).
An entry built before the graph existed is served one request per forward, with one line saying
to rebuild it (nothing is written at serve time).

Each request is a runtime.job.Job (the engine's own step machine), so the scheduler can put
many requests' verify rows into one call and still decode each as Engine.generate would.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Sequence, TypeVar

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from ..layouts import BATCHED_LAYOUTS
from ..log import logger
from ..runtime.job import Rows
from ..runtime.kv import round_up
from ..runtime.tree import NEG, row_bias, step_inputs
from ..schema import (
    GQA_POSITIONS,
    INPUTS_EMBEDS,
    KV_WRITE_INDEX,
    LOGITS,
    PAD_INDEX,
    QUERY_SEQLENS,
    SEQLENS_K,
    UNPAD_INDEX,
)

if TYPE_CHECKING:
    from ..runtime.decoder import Decoder
    from ..runtime.model import Model

Owner = TypeVar("Owner")  # what holds a slot (the scheduler's Request); opaque here


class BatchUnavailable(GenerationError):
    """This decoder cannot run batched (no rowwise or static KV layout, no gated batched graph of
    it in its entry, or rows not exact on this machine)."""


def open_batch(model: Model, max_batch: int) -> BatchDecoder[Any]:
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
    files = [f for f in (rec["file"], rec["file"] + ".data") if f in m.files]
    now = verify_entry(model.folder, files)
    if now.batched.get("sha256") != rec.get("sha256"):
        raise BatchUnavailable(f"{name} was rebuilt since {model.variant} was loaded: restart to batch requests")
    threads = model.decoder.s.get_session_options().intra_op_num_threads
    out = batch_decoder(model.decoder, model.folder / rec["file"], max_batch, threads)
    check_batched_graph(out.s.get_inputs(), c, model.folder / rec["file"], rebuild_hint(m, name))
    return out


def batch_decoder(decoder: Decoder, path: Path, max_batch: int, threads: int) -> BatchDecoder[Any]:
    """The batched graph at ``path``, made from ``decoder``'s graph, driven as its layout needs:
    RowwiseBatchDecoder for a rowwise decoder, BatchDecoder for a static one."""
    if decoder.c.kv_layout == S.KV_ROWWISE:
        return RowwiseBatchDecoder(decoder, path, max_batch, threads)
    if decoder.c.kv_layout == S.KV_STATIC:
        return BatchDecoder(decoder, path, max_batch, threads)
    raise BatchUnavailable(f"no batched serving for the {decoder.c.kv_layout} KV layout")


class BatchDecoder(Generic[Owner]):
    """A static variant's batched graph, its KV buffer and the slot of every active request; the
    interface the scheduler and measure_exact drive every layout's batch through (acquire,
    release, forward, commit, lengths, capacity, single_rows, last_run_s)."""

    def __init__(self, decoder: Decoder, path: Path, max_batch: int, threads: int):
        """``decoder``: the static variant ``path`` (its batched flavour) was made from."""
        import onnxruntime as ort

        from ..runtime.session import make_session

        c = decoder.c
        if c.mask_input is None:
            raise BatchUnavailable("the decoder has no mask input: batched serving needs a 4D mask")
        self.ort = ort
        self.decoder = decoder
        self.c = c
        self.mask_input: str = c.mask_input
        self.s = make_session(path, threads)
        self.max_batch = max_batch
        self.capacity = c.kv_capacity
        self.single_rows = decoder.single_rows  # graph rows a lone token costs (Job.single_rows)
        dtype = np.float16 if c.kv_dtype == "float16" else np.float32
        self.kv_in, self.kv_out = decoder.kv_in, decoder.kv_out
        # np.zeros maps pages lazily: memory grows with the contexts actually held.
        self.buf = np.zeros((len(self.kv_in), max_batch, c.num_kv_heads, self.capacity, c.head_dim), dtype=dtype)
        self.lengths = [0] * max_batch
        self.active = 0  # slots [0, active) are in use
        self.owners: list[Owner | None] = [None] * max_batch
        self._bindings: dict[tuple[int, int], Any] = {}  # onnxruntime IOBindings per slot range
        self.last_run_s = 0.0

    # ------------------------------------------------------------------ slots
    def acquire(self, owner: Owner | None) -> int:
        if self.active >= self.max_batch:
            raise GenerationError("no free batch slot")
        i = self.active
        self.active += 1
        self.owners[i], self.lengths[i] = owner, 0
        return i

    def release(self, slot: int) -> Owner | None:
        """Free ``slot``; the last active request moves into it (its KV rows copied) so the active
        slots stay a contiguous prefix. Returns the owner that moved, whose slot is now ``slot``."""
        last = self.active - 1
        moved = None
        if slot != last:
            n = self.lengths[last]
            self.buf[:, slot, :, :n] = self.buf[:, last, :, :n]
            self.lengths[slot] = n
            moved = self.owners[slot] = self.owners[last]
        self.owners[last] = None
        self.lengths[last] = 0
        self.active -= 1
        return moved

    def _binding(self, lo: int, hi: int) -> Any:
        key = (lo, hi)
        b = self._bindings.get(key)
        if b is None:
            b = self.s.io_binding()
            for j, (i_name, o_name) in enumerate(zip(self.kv_in, self.kv_out)):
                v = self.ort.OrtValue.ortvalue_from_numpy(self.buf[j, lo:hi])
                b.bind_ortvalue_input(i_name, v)
                b.bind_ortvalue_output(o_name, v)
            self._bindings[key] = b
        return b

    # ------------------------------------------------------------------ forward
    def forward(self, lo: int, rows: Sequence[Rows | None]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """One forward over slots ``lo .. lo+len(rows)``; ``None`` marks an idle slot. Returns per
        slot (logits [n, V], hidden [n, H] or None) for its real rows (copies; n = 0 for an idle
        slot), and commits nothing: the caller moves each slot's length with :meth:`commit`."""
        B = len(rows)
        fed: list[Rows | None] = []
        for r in rows:
            if r is not None and len(r.tokens) == 1 and r.slots is None:  # as Decoder.forward: one -> two rows
                r = Rows(r.tokens * 2, [-1, -1], None if r.embeds is None else np.concatenate([r.embeds] * 2))
            fed.append(r)
        widths = [
            0 if r is None else len(r.parents) if r.slots is not None and r.parents is not None else len(r.tokens)
            for r in fed
        ]
        S = max([2] + widths)  # attention slots per entry (a tree's aligned layout)
        lens = [self.lengths[lo + b] for b in range(B)]
        for b, r in enumerate(fed):
            if r is not None and lens[b] + S > self.capacity:
                raise GenerationError(
                    f"the KV cache holds {self.capacity} positions and this step needs "
                    f"{lens[b] + S}: use a shorter prompt or fewer new tokens"
                )
        width = max(1, max(lens[b] + widths[b] for b in range(B)))
        counts = [len(r.tokens) if r is not None else 0 for r in fed]
        T = sum(counts)
        ids = np.zeros((1, T), np.int64)
        pos = np.zeros((B, S), np.int64)
        pad_index = np.zeros((B, S), np.int64)
        unpad_index = np.zeros((1, T), np.int64)
        bias = np.full((B, 1, S, width), NEG, np.float32)
        seqlens = np.zeros(B, np.int32)
        qlens = np.zeros(B, np.int32)
        embeds = np.zeros((1, T, self.c.hidden_size), np.float32) if self.c.primary_input == INPUTS_EMBEDS else None
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        for b, r in enumerate(fed):
            P = lens[b]
            pos[b] = P
            if r is None:
                seqlens[b] = max(P - 1, 0)
                continue
            n, o, w = counts[b], int(offsets[b]), widths[b]
            parents = r.parents if r.parents is not None else list(range(-1, n - 1))
            slots = np.arange(n) if r.slots is None else np.asarray(r.slots, np.int64)
            p, m = step_inputs(parents, P)
            ids[0, o : o + n] = r.tokens
            pos[b, :w] = p[0]
            pad_index[b, :w] = o  # pad slots read the root row (their keys are masked)
            pad_index[b, slots] = o + np.arange(n)
            unpad_index[0, o : o + n] = b * S + slots
            bias[b, 0, :w, : P + w] = m[0, 0]
            seqlens[b], qlens[b] = P + w - 1, w
            if embeds is not None:
                embeds[0, o : o + n] = (
                    r.embeds
                    if r.embeds is not None
                    else self.decoder.embeddings(np.asarray(r.tokens, np.int64)[None])[0]
                )
        bind = self._binding(lo, lo + B)
        feeds = {
            GQA_POSITIONS: pos,
            self.mask_input: bias,
            SEQLENS_K: seqlens,
            QUERY_SEQLENS: qlens,
            PAD_INDEX: pad_index,
            UNPAD_INDEX: unpad_index,
        }
        feeds[self.c.primary_input] = embeds if embeds is not None else ids
        for name, arr in feeds.items():
            bind.bind_cpu_input(name, arr)
        V = self.c.vocab_size
        logits = np.empty((1, T, V), np.float32)
        bind.bind_ortvalue_output(LOGITS, self.ort.OrtValue.ortvalue_from_numpy(logits))
        hidden = None
        if self.c.hidden_output is not None:
            hidden = np.empty((1, T, self.c.hidden_size), np.float32)
            bind.bind_ortvalue_output(self.c.hidden_output, self.ort.OrtValue.ortvalue_from_numpy(hidden))
        t0 = time.perf_counter()
        self.s.run_with_iobinding(bind)
        self.last_run_s = time.perf_counter() - t0
        out = []
        for b, r in enumerate(rows):
            o, n = int(offsets[b]), (0 if r is None else len(r.tokens))  # a single token's pad row is dropped
            out.append((logits[0, o : o + n], hidden[0, o : o + n] if hidden is not None else None))
        return out

    def commit(self, slot: int, n_rows: int, keep: list[int]) -> None:
        """Keep this step's rows ``keep`` of ``slot`` (as StaticKV.commit)."""
        L = self.lengths[slot]
        k = len(keep)
        if keep != list(range(k)):
            src = L + np.asarray(keep, dtype=np.int64)
            rows = self.buf[:, slot]  # a view: [2 * layers, kv_heads, capacity, head_dim]
            rows[:, :, L : L + k] = rows[:, :, src]
        self.lengths[slot] = L + k


class RowwiseBatchDecoder(BatchDecoder[Owner]):
    """The batched graph of a rowwise decoder (export.passes.serve_batch_rowwise): each request's
    rows right-padded to the step's longest, its own buffer row of ``[B, KV, L, D]`` per layer's K
    or V, its own write index (its past length).

    Every request is fed exactly the rows the rowwise Decoder feeds it alone (a lone token is one
    row: the graph's one-row kernels and its row guard see to that); its pad rows are real graph
    rows whose K/V land past its length, where its real rows never look and its next step writes.
    The buffer's length L is shared by the batch and grows (and shrinks when the longest request
    leaves) in tiles like GrowingKV, without fresh memory: ``mem`` holds, per layer's K or V, the
    slots' ``[max_batch, KV, L, D]`` blocks at the current L, moved in place when L changes. A
    row's bits do not depend on L while it is a multiple of the tile (the gate checks it:
    requests alone run at their own L, side by side at the batch's)."""

    def __init__(self, decoder: Decoder, path: Path, max_batch: int, threads: int):
        """``decoder``: the rowwise variant ``path`` (its batched flavour) was made from."""
        import onnxruntime as ort

        from ..runtime.decoder import ROWWISE_TILE
        from ..runtime.session import make_session

        c = decoder.c
        if c.kv_layout != S.KV_ROWWISE or c.mask_input is None or c.position_input is None:
            raise BatchUnavailable("a rowwise batch needs a rowwise decoder with mask and position inputs")
        self.ort = ort
        self.decoder = decoder
        self.c = c
        self.mask_input = c.mask_input
        self.position_input: str = c.position_input
        self.s = make_session(path, threads)
        self.max_batch = max_batch
        self.capacity = c.kv_capacity
        self.single_rows = decoder.single_rows
        self.tile = ROWWISE_TILE
        self.dtype = np.float16 if c.kv_dtype == "float16" else np.float32
        self.kv_in, self.kv_out = decoder.kv_in, decoder.kv_out
        self.heads, self.head_dim = c.num_kv_heads, c.head_dim
        # room for the capacity plus a tile of pad rows per slot; np.zeros maps pages lazily
        self.room = round_up(self.capacity, self.tile) + self.tile
        self.mem = np.zeros((len(self.kv_in), max_batch * self.heads * self.room * self.head_dim), self.dtype)
        self.size = 0  # L, the bound buffer's positions (a multiple of the tile)
        self.buf = self._view(0)
        self.lengths = [0] * max_batch
        self.active = 0
        self.owners: list[Owner | None] = [None] * max_batch
        self._bindings: dict[tuple[int, int], Any] = {}
        self.last_run_s = 0.0

    # ------------------------------------------------------------------ the buffer
    def _view(self, size: int, mem: np.ndarray | None = None) -> np.ndarray:
        """Every slot's blocks at length ``size``: [2 * layers, max_batch, KV, size, D], a view of mem."""
        mem = self.mem if mem is None else mem
        n = self.max_batch * self.heads * size * self.head_dim
        return mem[:, :n].reshape(len(mem), self.max_batch, self.heads, size, self.head_dim)

    def _resize(self, size: int) -> None:
        """Rebind the buffer at length ``size``, each active slot's committed positions moved to
        their new place (in ``mem`` itself: later blocks first when it grows, earlier first when it
        shrinks, so nothing is overwritten unread; a fresh ``mem`` when the room is exceeded).
        The gaps keep stale but finite values, which the masks zero exactly."""
        if size == self.size:
            return
        old, mem = self.buf, self.mem
        if size > self.room:  # more pad rows than a tile past the capacity: room for them
            self.room = round_up(size, self.tile) + self.tile
            mem = np.zeros((len(self.mem), self.max_batch * self.heads * self.room * self.head_dim), self.dtype)
        new = self._view(size, mem)
        blocks = [(b, h) for b in range(self.active) for h in range(self.heads)]
        for b, h in reversed(blocks) if size > self.size else blocks:
            n = self.lengths[b]
            if n and (mem is not self.mem or b or h):  # block (0, 0) never moves within mem
                new[:, b, h, :n] = old[:, b, h, :n]
        self.mem, self.buf, self.size = mem, new, size
        self._bindings.clear()

    def _fit(self, need: int) -> None:
        """L covers ``need`` positions: grown in GrowingKV's steps (``tile * isqrt(L / 4 tile)``)."""
        if need > self.size:
            t = self.tile
            step = t * max(1, math.isqrt(max(need, self.size) // (4 * t)))
            self._resize(round_up(max(need, self.size + step), t))

    def release(self, slot: int) -> Owner | None:
        """As BatchDecoder.release; the buffer shrinks to the remaining requests' lengths when they
        need half of it or less (every step attends to the whole buffer)."""
        moved = super().release(slot)
        longest = max(self.lengths[: self.active], default=0)
        if not self.active:
            self._resize(0)
        elif round_up(longest + self.tile, self.tile) * 2 <= self.size:
            self._resize(round_up(longest + self.tile, self.tile))
        return moved

    # ------------------------------------------------------------------ forward
    def forward(self, lo: int, rows: Sequence[Rows | None]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """As BatchDecoder.forward: one forward over slots ``lo .. lo+len(rows)`` (``None``: an
        idle slot, fed pad rows only), each request's rows as the rowwise Decoder feeds them (a
        chain, or a tree one row per node through ``parents``; no slot layouts)."""
        B = len(rows)
        counts = [0 if r is None else len(r.tokens) for r in rows]
        R = max([1] + counts)
        lens = [self.lengths[lo + b] for b in range(B)]
        for b, r in enumerate(rows):
            if r is None:
                continue
            if r.slots is not None:
                raise GenerationError("a rowwise decoder verifies chains only: it has no slot layout for trees")
            if lens[b] + counts[b] > self.capacity:
                raise GenerationError(
                    f"the KV cache holds {self.capacity} positions and this step needs "
                    f"{lens[b] + counts[b]}: use a shorter prompt or fewer new tokens"
                )
        self._fit(max(lens) + R)  # every slot in the range writes R rows at its length
        L = self.size
        ids = np.zeros((B, R), np.int64)
        pos = np.zeros((B, R), np.int64)
        bias = np.full((B, 1, R, L), NEG, np.float32)
        write = np.asarray(lens, np.int64)
        embeds = np.zeros((B, R, self.c.hidden_size), np.float32) if self.c.primary_input == INPUTS_EMBEDS else None
        keys = np.arange(L)
        steps = np.arange(R)
        for b, r in enumerate(rows):
            P, n = lens[b], counts[b]
            # pad rows (and an idle slot's rows) repeat the last real row's token and position:
            # finite K/V written past the request's length, attended by nothing real
            # row i of a chain sees the past and rows 0..i; a pad row sees its own write position too
            bias[b, 0] = np.where(keys[None, :] <= P + steps[:, None], 0.0, NEG)
            if r is not None and r.parents is not None:  # a tree, one row per node
                tp, tb = row_bias(list(r.parents), P, L)
                pos[b, :n], bias[b, 0, :n] = tp[0], tb[0, 0]
                pos[b, n:] = tp[0, -1]
            else:
                pos[b] = P + np.minimum(steps, max(n - 1, 0))
            np.minimum(pos[b], self.capacity - 1, out=pos[b])
            if r is None:
                continue
            ids[b, :n] = r.tokens
            ids[b, n:] = r.tokens[-1]
            if embeds is not None:
                embeds[b, :n] = (
                    r.embeds
                    if r.embeds is not None
                    else self.decoder.embeddings(np.asarray(r.tokens, np.int64)[None])[0]
                )
                embeds[b, n:] = embeds[b, n - 1]
        bind = self._binding(lo, lo + B)
        feeds = {
            self.position_input: pos,
            self.mask_input: bias,
            KV_WRITE_INDEX: write,
            self.c.primary_input: embeds if embeds is not None else ids,
        }
        for name, arr in feeds.items():
            bind.bind_cpu_input(name, arr)
        logits = np.empty((B, R, self.c.vocab_size), np.float32)
        bind.bind_ortvalue_output(LOGITS, self.ort.OrtValue.ortvalue_from_numpy(logits))
        hidden = None
        if self.c.hidden_output is not None:
            hidden = np.empty((B, R, self.c.hidden_size), np.float32)
            bind.bind_ortvalue_output(self.c.hidden_output, self.ort.OrtValue.ortvalue_from_numpy(hidden))
        t0 = time.perf_counter()
        self.s.run_with_iobinding(bind)
        self.last_run_s = time.perf_counter() - t0
        return [(logits[b, : counts[b]], hidden[b, : counts[b]] if hidden is not None else None) for b in range(B)]


# What the server checks on its own machine before it batches (a few forwards) and what the build
# gates the graph with: (past, row counts of its steps) per request, side by side in one batch.
START_CHECK = ((11, (1, 3, 5)), (23, (5, 1, 3)))
# the build's gate: pasts whose steps cross 64 and 256 positions, steps of 1 (padded to two rows) to 8 rows
GATE_CHECK = ((11, (1, 3, 5, 8)), (70, (5, 8, 1, 3)), (250, (3, 1, 8, 5)))


def measure_exact(dec: Decoder, batch: BatchDecoder[Any], cases=START_CHECK, seed: int = 0) -> dict:
    """Whether the batched graph's rows equal the single-request decoder's bit for bit here: each
    case is one request (a random prompt of ``past`` tokens, then steps of the given row counts),
    every request prefilled through the batched graph alone, then their steps side by side in
    one forward; the prefill and every step's logits are compared with ``dec`` decoding that
    request alone. Cases that do not fit the KV capacity or the batch are left out."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    V = dec.c.vocab_size
    cases = [(p, st) for p, st in cases if p + sum(st) + 2 <= batch.capacity][: batch.max_batch]
    prompts = [rng.integers(0, V, p).tolist() for p, _ in cases]
    want = []
    for p, (_, st) in zip(prompts, cases):
        kv = dec.new_cache()
        try:
            lg, _, pr = dec.forward(p, None, kv)
            outs = [(p, lg.copy())]
            kv.commit(pr, len(p), list(range(len(p))))
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
        for b, (s, p) in enumerate(zip(slots, prompts)):
            ((lg, _),) = batch.forward(s, [Rows(p, None)])
            compare(b, 0, lg)
            batch.commit(s, len(p), list(range(len(p))))
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


def check_exact(dec: Decoder, batch: BatchDecoder[Any]) -> bool:
    """The server's start-up check (START_CHECK): a few forwards on the machine it serves on."""
    return measure_exact(dec, batch, START_CHECK)["passed"]
