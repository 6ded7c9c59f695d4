"""The rowwise KV layout: every query row on ORT's one-row attention kernels, K/V written in place
(``TensorScatter`` at ``kv_write_index``) into a bound buffer that grows in tiles
(export.passes.rowwise_kv). A token costs one graph row whether decoded alone or verified among
others, and its logits are bit-identical either way: a lone token is one row (``one_row``), and the
one-row kernels block keys from key 0, so trees are verified as chains.

The buffer's length is a multiple of ``TILE`` positions (a multiple of the kernels' key blocks, so
a row's bits do not depend on it): one request's (``GrowingKV``, fed by ``RowFeeds``) and the
server's batch's (``RowwiseBatch``, export.passes.serve_batch_rowwise) grow in the steps of
``grown``; the gates' explicit pasts are padded to the next tile (``RowwiseDriver.past_feeds``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from ..runtime.tree import NEG, row_bias
from .base import (
    BatchDriver,
    BatchUnavailable,
    Driver,
    Host,
    Layout,
    Out,
    Owner,
    Rows,
    bind_kv,
    check_room,
    kv_dtype,
    kv_zeros,
)
from .static import StaticKV

TILE = 64  # the rowwise buffer grows in multiples of this many positions


def round_up(n: int, tile: int = TILE) -> int:
    """``n`` rounded up to a whole number of ``tile``: the rowwise buffer's lengths."""
    return -(-n // tile) * tile


def growth(positions: int, tile: int = TILE) -> int:
    """How far a buffer grows past ``positions``: ``tile * isqrt(positions / (4 tile))`` -- a
    copy's cost grows with the length, a step's masked tail with the step."""
    return tile * max(1, math.isqrt(positions // (4 * tile)))


def grown(size: int, need: int, tile: int = TILE) -> int:
    """The buffer length after growing one of ``size`` positions to hold ``need``."""
    return round_up(max(need, size + growth(max(need, size), tile)), tile)


class GrowingKV(StaticKV):
    """The rowwise flavour's in-place cache: StaticKV whose bound buffers ``[1, KV, L, D]`` grow.

    Why grow: the rowwise graph's attention runs over the whole bound buffer (masked beyond the
    context), and every masked key costs what a real one does (measured: docs/runtime.md), so L
    tracks the context instead of the capacity. L stays a multiple of ``tile`` (a multiple of the
    kernels' key blocks, so a step's logits do not depend on L, which the batched gate checks
    across growths).

    How it grows without copying into fresh memory: each layer's K or V owns one row of ``mem``,
    sized for the capacity up front (pages are mapped only as the context reaches them), and the
    bound tensor is its first ``KV * L * D`` values. Growing to L' moves heads KV-1 .. 1 to their
    new offsets inside the same memory (head 0 stays put), one numpy copy per head for all layers
    at once; the gaps keep stale but finite values, which the mask zeroes exactly. A fresh, zeroed
    buffer per growth paid page faults for every position at every growth (docs/runtime.md), which
    had to be avoided by reserving a whole generation's room up front at the cost of reading it,
    masked, at every step. Growth steps are sized by ``growth``.
    ``mem`` (with the binding) is reused by the next request, starting small again.
    """

    def __init__(self, driver: Any, binding: Any, *, tile: int, capacity: int, mem: np.ndarray | None = None):
        c = driver.c
        if mem is None:
            mem = kv_zeros((len(driver.kv_in), c.num_kv_heads * capacity * c.head_dim), kv_dtype(c))
        self.mem = mem
        self.dec = driver
        super().__init__(driver, self._view(0), binding)
        self.tile = tile
        self.capacity = capacity
        self.size = 0
        self.bound: Any = None  # the driver's RowFeeds last bound to this binding (rebound when it changes)

    def _view(self, size: int) -> np.ndarray:
        """The first ``size`` positions' layout: [2 * layers, 1, KV, size, D], a view of ``mem``."""
        c = self.dec.c
        return self.mem[:, : c.num_kv_heads * size * c.head_dim].reshape(
            len(self.mem), 1, c.num_kv_heads, size, c.head_dim
        )

    def step(self, positions: int) -> int:
        """How far the buffer grows past ``positions`` (``growth``)."""
        return growth(positions, self.tile)

    def reserve(self, prompt: int, decode: int) -> None:
        """Before the prompt's last chunk: room for the prompt and as much of the decoding as one
        growth step would give, so short generations never grow (a one-chunk prompt: nothing to
        move yet). Earlier chunks grow the buffer as they go: a chunk attends to the whole buffer,
        so reserving the prompt's full length up front slows a long prefill (docs/runtime.md)."""
        self.ensure(min(self.capacity, prompt + min(decode, self.step(prompt))))

    def ensure(self, positions: int) -> None:
        if positions <= self.size:
            return
        size = min(self.capacity, grown(self.size, positions, self.tile))
        old, new = self.buffers(), self._view(size)
        for h in range(self.dec.c.num_kv_heads - 1, 0, -1):  # later heads first: nothing is overwritten unread
            new[:, :, h, : self.length] = old[:, :, h, : self.length]
        bind_kv(self.binding, self.dec.kv_in, self.dec.kv_out, new)
        self.buf, self.size = new, size

    def release(self) -> None:
        if self.binding is not None:
            self.dec.reclaim(self.mem, self.binding)
            self.buf = self.binding = None


class RowFeeds:
    """A rowwise step's inputs and outputs for ``n`` rows over a ``size``-position buffer, as numpy
    arrays bound once as OrtValues sharing their memory: a step writes ids, positions, the write
    index and the mask rows in place, and the run writes logits and hidden states into them.

    Why by hand: binding fresh arrays per step, and allocating a fresh O(size) mask, is a visible
    share of a decode step's host time (measured: docs/runtime.md); onnxruntime's IOBinding keeps a
    bound OrtValue across runs, so reusing the same memory makes the step's host work a few writes.
    """

    KEEP_ROWS = 64  # row counts up to this keep their feeds between steps (drafts; not prefill chunks)

    def __init__(
        self,
        c: S.Contract,
        n: int,
        size: int,
        outputs: tuple[np.ndarray, np.ndarray | None],
        start: np.ndarray | None = None,
    ):
        self.c, self.n, self.size = c, n, size
        self.start = start  # [1]: the first row with logits (LOGITS_FROM); None: a graph without it
        self.ids = np.zeros((1, n), np.int64)
        self.embeds = np.zeros((1, n, c.hidden_size), np.float32) if c.primary_input == S.INPUTS_EMBEDS else None
        self.pos = np.zeros((1, n), np.int64)
        self.write = np.zeros(1, np.int64)
        self.bias = np.empty((1, 1, n, size), np.float32)
        self.logits, self.hidden = outputs  # views of the driver's reused output array
        # row r of a chain's mask over past p is zeros up to key p + r: the window of ``ramp``
        # (size zeros, then NEG) that starts at size - p - r - 1; windows are views, one copy fills all rows
        ramp = np.concatenate([np.zeros(size, np.float32), np.full(size, NEG, np.float32)])
        self._windows = np.lib.stride_tricks.sliding_window_view(ramp, size)
        self._steps = np.arange(n, dtype=np.int64)

    def fill(self, tokens, parents: list[int] | None, past: int) -> None:
        if self.embeds is None:
            self.ids[0] = tokens
        self.write[0] = past
        if parents is None:
            np.add(self._steps, past, out=self.pos[0])
            start = self.size - past - self.n
            np.copyto(self.bias[0, 0], self._windows[start : start + self.n][::-1])
        else:
            pos, bias = row_bias(parents, past, self.size)
            self.pos[:], self.bias[:] = pos, bias

    def bind(self, binding) -> None:
        import onnxruntime as ort

        c = self.c
        primary = (S.INPUTS_EMBEDS, self.embeds) if self.embeds is not None else (S.INPUT_IDS, self.ids)
        for name, arr in (
            primary,
            (c.position_input, self.pos),
            (c.mask_input, self.bias),
            (S.KV_WRITE_INDEX, self.write),
            *([(S.LOGITS_FROM, self.start)] if self.start is not None else []),
        ):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        binding.bind_ortvalue_output(S.LOGITS, ort.OrtValue.ortvalue_from_numpy(self.logits))
        if self.hidden is not None:
            binding.bind_ortvalue_output(c.hidden_output, ort.OrtValue.ortvalue_from_numpy(self.hidden))


class RowwiseDriver(Driver):
    """One row per token, whatever the step (no pad row); the rows' K/V go to ``kv.length ..`` in
    order and each row gets its own mask over the bound buffer (``parents``: a tree fed one row per
    node, e.g. by the gates; the engine sends chains). Inputs and outputs live in reused, already
    bound arrays (RowFeeds): a decode step only writes a few numbers into them before the run."""

    one_row = True

    def __init__(self, dec: Host):
        super().__init__(dec)
        self._feeds: dict[tuple[int, int], RowFeeds] = {}  # bound inputs/outputs per (rows, first logits row)
        self._feeds_size = 0

    def new_cache(self) -> GrowingKV:
        # memory and binding are reused; the bound buffer starts small again
        if self.free:
            mem, binding = self.free.pop()
            return GrowingKV(self, binding, tile=TILE, capacity=self.c.kv_capacity, mem=mem)
        return GrowingKV(self, self.dec.s.io_binding(), tile=TILE, capacity=self.c.kv_capacity)

    def forward(
        self,
        tokens: Sequence[int],
        parents: list[int] | None,
        kv: Any,
        embeds: np.ndarray | None = None,
        copy: bool = True,
        slots: Sequence[int] | None = None,
        last: int | None = None,
    ) -> Out:
        assert isinstance(kv, GrowingKV), "a rowwise decoder's cache comes from its new_cache()"
        if slots is not None:
            raise GenerationError("a rowwise decoder verifies chains only: it has no slot layout for trees")
        n, past = len(tokens), kv.length
        check_room(kv, n)
        kv.ensure(past + n)
        f = self.row_feeds(n, kv.size, self.logits_start(n, last))
        f.fill(tokens, parents, past)
        if f.embeds is not None:  # an inputs_embeds decoder
            f.embeds[:] = embeds if embeds is not None else self.dec.embeddings(np.asarray(tokens, np.int64)[None])
        if kv.bound is not f:
            f.bind(kv.binding)
            kv.bound = f
        self.run_bound(kv.binding)
        logits, hidden = f.logits[0], (f.hidden[0] if f.hidden is not None else None)
        return (logits.copy(), hidden.copy() if hidden is not None else None, None) if copy else (logits, hidden, None)

    def prefill(self, tokens: Sequence[int], kv: Any, prompt: int, room: int, embeds: np.ndarray | None = None) -> Out:
        """runtime.decoder.Decoder.prefill on a rowwise decoder: before the prompt's last chunk the
        buffer makes room for the decoding (GrowingKV.reserve; earlier chunks must not attend to
        it), and with a prefill graph (export.passes.rowwise_prefill) the chunk's rows run as rows
        of one multi-row attention over the same buffer, its K/V written where the decode graph
        would write them. Its feeds are made and bound per chunk (a chunk's run dwarfs that)."""
        assert isinstance(kv, GrowingKV), "a rowwise decoder's cache comes from its new_cache()"
        n, past = len(tokens), kv.length
        if past + n >= prompt:
            kv.reserve(prompt, room)
        session = self.dec.prefill_s
        if session is None:
            return self.forward(tokens, None, kv, None if embeds is None else embeds[None], copy=False, last=1)
        check_room(kv, n)
        kv.ensure(past + n)
        start = self.logits_start(n, 1)
        f = RowFeeds(
            self.c, n, kv.size, self.outputs(n, start), np.array([start], np.int64) if self.logits_from else None
        )
        f.fill(tokens, None, past)
        if f.embeds is not None:
            f.embeds[0] = embeds if embeds is not None else self.dec.embeddings(np.asarray(tokens, np.int64)[None])[0]
        binding = session.io_binding()
        bind_kv(binding, self.kv_in, self.kv_out, kv.buffers())
        f.bind(binding)
        self.run_bound(binding, session)
        return f.logits[0], (f.hidden[0] if f.hidden is not None else None), None

    def row_feeds(self, n: int, size: int, start: int = 0) -> RowFeeds:
        """The reusable feeds for ``n`` rows over a buffer of ``size`` positions, logits from row
        ``start`` on: kept for decode-sized steps (a buffer growth drops them all), made fresh for
        longer prefill chunks."""
        if size != self._feeds_size:
            self._feeds, self._feeds_size = {}, size
        f = self._feeds.get((n, start))
        if f is None:
            first = np.array([start], np.int64) if self.logits_from else None
            f = RowFeeds(self.c, n, size, self.outputs(n, start), first)
            if n <= RowFeeds.KEEP_ROWS:
                self._feeds[(n, start)] = f
        return f

    def past_feeds(
        self, past: dict[str, np.ndarray], bias: np.ndarray, rows: int
    ) -> tuple[dict[str, np.ndarray], np.ndarray, int | None]:
        """The past arrays and the mask padded to a whole number of tiles (what the runtime binds),
        the write index at the past's end; the present is cut back to past + new."""
        total = bias.shape[-1]
        pad = round_up(total) - total
        feeds = {k: np.pad(v, ((0, 0), (0, 0), (0, pad + total - v.shape[2]), (0, 0))) for k, v in past.items()}
        bias = np.pad(bias, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=NEG)
        feeds[S.KV_WRITE_INDEX] = np.array([total - rows], np.int64)
        return feeds, bias, total


class RowwiseBatch(BatchDriver[Owner]):
    """The batched graph of a rowwise decoder (export.passes.serve_batch_rowwise): each request's
    rows right-padded to the step's longest, its own buffer row of ``[B, KV, L, D]`` per layer's K
    or V, its own write index (its past length).

    Every request is fed exactly the rows RowwiseDriver feeds it alone (a lone token is one row:
    the graph's one-row kernels and its row guard see to that); its pad rows are real graph rows
    whose K/V land past its length, where its real rows never look and its next step writes.
    The buffer's length L is shared by the batch and grows (and shrinks when the longest request
    leaves) in tiles like GrowingKV, without fresh memory: ``mem`` holds, per layer's K or V, the
    slots' ``[max_batch, KV, L, D]`` blocks at the current L, moved in place when L changes. A
    row's bits do not depend on L while it is a multiple of the tile (the gate checks it:
    requests alone run at their own L, side by side at the batch's)."""

    def __init__(self, decoder: Host, path: Path, max_batch: int, threads: int):
        c = decoder.c
        if c.kv_layout != S.KV_ROWWISE or c.mask_input is None or c.position_input is None:
            raise BatchUnavailable("a rowwise batch needs a rowwise decoder with mask and position inputs")
        super().__init__(decoder, path, max_batch, threads)
        self.position_input: str = c.position_input
        self.tile = TILE
        self.dtype = kv_dtype(c)
        self.heads, self.head_dim = c.num_kv_heads, c.head_dim
        # room for the capacity plus a tile of pad rows per slot; pages touched lazily (base.kv_zeros)
        self.room = round_up(self.capacity, self.tile) + self.tile
        self.mem = kv_zeros((len(self.kv_in), max_batch * self.heads * self.room * self.head_dim), self.dtype)
        self.size = 0  # L, the bound buffer's positions (a multiple of the tile)
        self.buf = self._view(0)

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
            mem = kv_zeros((len(self.mem), self.max_batch * self.heads * self.room * self.head_dim), self.dtype)
        new = self._view(size, mem)
        blocks = [(b, h) for b in range(self.active) for h in range(self.heads)]
        for b, h in reversed(blocks) if size > self.size else blocks:
            n = self.lengths[b]
            if n and (mem is not self.mem or b or h):  # block (0, 0) never moves within mem
                new[:, b, h, :n] = old[:, b, h, :n]
        self.mem, self.buf, self.size = mem, new, size
        self._bindings.clear()

    def fit(self, positions: int) -> None:
        """L covers ``positions``: grown in GrowingKV's steps (``grown``)."""
        if positions > self.size:
            self._resize(grown(self.size, positions, self.tile))

    def release(self, slot: int) -> Owner | None:
        """As BatchDriver.release; the buffer shrinks to the remaining requests' lengths when they
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
        """As BatchDriver.forward, each request's rows as RowwiseDriver feeds them (``None``: an idle
        slot, fed pad rows only; a chain, or a tree one row per node through ``parents``; no slot
        layouts)."""
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
        self.fit(max(lens) + R)  # every slot in the range writes R rows at its length
        L = self.size
        ids = np.zeros((B, R), np.int64)
        pos = np.zeros((B, R), np.int64)
        bias = np.full((B, 1, R, L), NEG, np.float32)
        write = np.asarray(lens, np.int64)
        embeds = np.zeros((B, R, self.c.hidden_size), np.float32) if self.c.primary_input == S.INPUTS_EMBEDS else None
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
                embeds[b, :n] = self.embeddings(r)
                embeds[b, n:] = embeds[b, n - 1]
        bind = self.binding(lo, lo + B)
        feeds = {
            self.position_input: pos,
            self.mask_input: bias,
            S.KV_WRITE_INDEX: write,
            self.c.primary_input: embeds if embeds is not None else ids,
        }
        for name, arr in feeds.items():
            bind.bind_cpu_input(name, arr)
        logits, hidden = self.bind_outputs(bind, (B, R))
        self.run_bound(bind)
        return [(logits[b, : counts[b]], hidden[b, : counts[b]] if hidden is not None else None) for b in range(B)]


def _graph_pass(proto: Any, capacity: int) -> Any:
    from ..export.passes.rowwise_kv import to_rowwise_kv  # onnx: loaded only by a build that writes it

    return to_rowwise_kv(proto, capacity)


def _batch_pass(proto: Any, source: str) -> Any:
    from ..export.passes.serve_batch_rowwise import to_serve_batch_rowwise

    return to_serve_batch_rowwise(proto, source)


def _prefill_pass(proto: Any, source: str) -> Any:
    from ..export.passes.rowwise_prefill import to_rowwise_prefill

    return to_rowwise_prefill(proto, source)


LAYOUT = Layout(
    S.KV_ROWWISE,
    rank=1,
    in_place=True,
    driver=RowwiseDriver,
    step="rowwise KV flavour of {p} (one-row attention in place, capacity {c})",
    graph_pass=_graph_pass,
    batch=S.KV_ROWWISE,
    batch_pass=_batch_pass,
    batch_driver=RowwiseBatch,
    prefill_pass=_prefill_pass,
)
