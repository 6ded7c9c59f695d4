"""The decoder graph's I/O: one onnxruntime session driven through its contract.

Why apart from the loop: the gates, the calibration, the model drafter and the server's exactness
check run the same forwards without a generation around them. ``Decoder.forward`` feeds tokens
(a chain, a tree's rows or its aligned slots) over a KV cache from ``new_cache`` and returns
logits, hidden states and the concat layout's present; ``RowFeeds`` holds a rowwise step's bound
inputs and outputs.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..errors import GenerationError
from ..schema import (
    INPUT_IDS,
    INPUTS_EMBEDS,
    KV_ROWWISE,
    KV_WRITE_INDEX,
    LOGITS,
    MASK_ADDITIVE_4D,
    ROW_SLOTS,
    SLOT_ROWS,
    Contract,
    in_place,
)
from .kv import Cache, GrowingKV, KVCache, StaticKV
from .tree import NEG, causal_inputs, row_bias, slot_tokens, step_inputs

ROWWISE_TILE = 64  # the rowwise buffer grows in multiples of this many positions (GrowingKV)


class Decoder:
    """One ORT decoder session driven through its (derived) contract."""

    def __init__(self, session: Any, contract: Contract, embed: Callable[[np.ndarray], np.ndarray] | None = None):
        self.s = session
        self.c = contract
        self.embed = embed
        self.out_names = [o.name for o in session.get_outputs()]
        self.kv_in = [
            contract.kv_input_pattern.format(i=i, kv=kv) for i in range(contract.num_layers) for kv in ("key", "value")
        ]
        self.kv_out = [
            contract.kv_output_pattern.format(i=i, kv=kv) for i in range(contract.num_layers) for kv in ("key", "value")
        ]
        self.has_hidden = contract.hidden_output is not None
        if contract.mask_kind == MASK_ADDITIVE_4D and contract.mask_input is None:
            raise GenerationError(
                "the contract's mask is additive_4d but names no mask input: re-derive it from the graph"
            )
        # the 4D additive mask's input (trees and chains); None: a 2D padding mask or none
        self._bias_input = contract.mask_input if contract.mask_kind == MASK_ADDITIVE_4D else None
        # rowwise graphs run every row on one-row kernels, and a length-invariant graph (row guard,
        # export.passes.row_guard) pads inside itself where an op needs it: a lone token is one row
        self.rowwise = contract.kv_layout == KV_ROWWISE
        self.pad_single = not (
            self.rowwise or contract.length_invariant
        )  # see forward(); changed only through padding()
        self.last_run_s = 0.0  # seconds inside onnxruntime's run in the last forward
        self.outputs = ["logits"] + (["hidden_states"] if self.has_hidden else []) + self.kv_out
        self.static = in_place(contract.kv_layout)  # buffers bound as past and present
        self.capacity = contract.kv_capacity if self.static else 0
        # released in-place buffers (StaticKV's buffer or GrowingKV's memory) with their IOBinding,
        # reused by the next generation (reclaim)
        self._free: list[tuple[np.ndarray, Any]] = []
        self._out_buf = np.zeros(0, dtype=np.float32)
        # rows decoupled from attention slots (export.passes.static_kv): pad slots cost attention only
        self.sparse = SLOT_ROWS in {i.name for i in session.get_inputs()}
        self._arange = np.zeros(0, dtype=np.int64)
        self._feeds: dict[int, RowFeeds] = {}  # rowwise: bound inputs/outputs per row count
        self._feeds_size = 0

    def reclaim(self, buffers: np.ndarray, binding: Any) -> None:
        """Take back a released cache's buffers and their IOBinding (StaticKV.release): the next
        new_cache reuses them instead of mapping a capacity's worth of fresh memory."""
        self._free.append((buffers, binding))

    @property
    def pooled(self) -> list[np.ndarray]:
        """The released buffers waiting for reuse (in release order)."""
        return [b for b, _ in self._free]

    @contextmanager
    def padding(self, pad: bool) -> Iterator[Decoder]:
        """``pad_single`` is ``pad`` inside the block and the decoder's own setting again after:
        the gates time the raw one-row path with it and the bench its one-row reference; the
        runtime never changes it (Engine and Model.plan read it to know what a lone token costs)."""
        old, self.pad_single = self.pad_single, pad
        try:
            yield self
        finally:
            self.pad_single = old

    @property
    def single_rows(self) -> int:
        """Graph rows a lone token's step runs (its pad row, if any)."""
        return 2 if self.pad_single else 1

    def new_cache(self) -> Cache:
        dtype = np.float16 if self.c.kv_dtype == "float16" else np.float32
        if not self.static:
            return KVCache(self.kv_in, np.zeros((1, self.c.num_kv_heads, 0, self.c.head_dim), dtype=dtype))
        if self.rowwise:
            # memory and binding are reused; the bound buffer starts small again (GrowingKV)
            if self._free:
                mem, binding = self._free.pop()
                return GrowingKV(self, binding, tile=ROWWISE_TILE, capacity=self.capacity, mem=mem)
            return GrowingKV(self, self.s.io_binding(), tile=ROWWISE_TILE, capacity=self.capacity)
        if self._free:
            buf, binding = self._free.pop()
        else:
            import onnxruntime as ort

            # np.zeros maps pages lazily: a long capacity costs memory only as the context grows.
            buf = np.zeros((len(self.kv_in), 1, self.c.num_kv_heads, self.capacity, self.c.head_dim), dtype=dtype)
            binding = self.s.io_binding()
            for j, (i_name, o_name) in enumerate(zip(self.kv_in, self.kv_out)):
                v = ort.OrtValue.ortvalue_from_numpy(buf[j])
                binding.bind_ortvalue_input(i_name, v)
                binding.bind_ortvalue_output(o_name, v)
        return StaticKV(self, buf, binding)

    def forward(
        self,
        tokens: Sequence[int],
        parents: list[int] | None,
        kv: Cache,
        embeds: np.ndarray | None = None,
        copy: bool = True,
        slots: Sequence[int] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None, list[np.ndarray] | None]:
        """Run new ``tokens`` (a chain when ``parents`` is None) over the cached past.

        ``slots``: a tree in an aligned slot layout (Job.plan): ``parents`` then covers the slots
        (pads: -1) and ``slots[i]`` is token i's slot; outputs come back per token. A graph with
        rows decoupled from slots (export.passes.static_kv) runs the tokens only; others run every slot.

        A single token is padded to two graph rows: ORT's kernels take another path for one
        row (GEMV) than for several, and int8-activation kernels amplify that last-bit
        difference into different argmaxes. With every forward on the multi-row path, a token's
        logits are bit-identical whether it is verified alone or in a batch of drafts — which is
        what makes speculative decoding exactly equal to plain decoding. The pad sits after the
        real row, which never attends to it, and its output and KV are dropped.
        """
        if self.rowwise:
            assert isinstance(kv, GrowingKV), "a rowwise decoder's cache comes from its new_cache()"
            return self._forward_rowwise(tokens, parents, kv, embeds, copy, slots)
        if slots is not None and parents is None:
            raise GenerationError("a slot layout needs its parents per slot (pads: -1)")
        if slots is not None and not self.sparse:
            assert parents is not None
            slots = list(slots)
            logits, hidden, present = self.forward(
                slot_tokens(list(tokens), slots, len(parents)), parents, kv, embeds, copy=copy
            )
            return logits[slots], (hidden[slots] if hidden is not None else None), present
        n = len(tokens)
        past = kv.length
        pad = n == 1 and self.pad_single
        toks = np.asarray(list(tokens) * 2 if pad else tokens, dtype=np.int64)
        if pad:
            parents = [-1, -1]
            if embeds is not None:
                embeds = np.concatenate([embeds, embeds], axis=1)
        feeds: dict[str, np.ndarray] = {} if isinstance(kv, StaticKV) else dict(kv.feeds())
        if self.c.primary_input == INPUTS_EMBEDS:
            feeds[INPUTS_EMBEDS] = embeds if embeds is not None else self.embeddings(toks[None])
        else:
            feeds[INPUT_IDS] = toks[None]
        m = (
            len(parents) if slots is not None and parents is not None else len(toks)
        )  # attention slots (graph rows if dense)
        if self._bias_input is not None:
            pos, bias = causal_inputs(m, past) if parents is None else step_inputs(parents, past)
            feeds[self._bias_input] = bias
        else:
            if parents is not None and parents != list(range(-1, m - 1)) and not pad:
                raise GenerationError("this decoder has no 4D mask input: it can verify chains only")
            pos = np.arange(past, past + m, dtype=np.int64)[None]
            if self.c.mask_input:
                feeds[self.c.mask_input] = np.ones((1, past + m), dtype=np.int64)
        if self.c.position_input:
            feeds[self.c.position_input] = pos
        if self.sparse:
            if slots is None:
                feeds[SLOT_ROWS] = feeds[ROW_SLOTS] = self._identity(m)
            else:
                slot_rows = np.zeros(m, np.int64)
                slot_rows[list(slots)] = np.arange(n)
                feeds[SLOT_ROWS], feeds[ROW_SLOTS] = slot_rows, np.asarray(slots, np.int64)
        if isinstance(kv, StaticKV):
            return self._run_static(feeds, kv, n, m, len(toks), copy)
        t0 = time.perf_counter()
        out = self.s.run(self.outputs, feeds)
        self.last_run_s = time.perf_counter() - t0
        logits = out[0][0][:n]
        hidden = out[1][0][:n] if self.has_hidden else None
        present = out[2:] if self.has_hidden else out[1:]
        if pad:
            present = [a[:, :, : past + 1] for a in present]
        return logits, hidden, present

    def _forward_rowwise(
        self,
        tokens: Sequence[int],
        parents: list[int] | None,
        kv: GrowingKV,
        embeds: np.ndarray | None,
        copy: bool,
        slots: Sequence[int] | None,
    ) -> tuple[np.ndarray, np.ndarray | None, None]:
        """The rowwise graph: one row per token, whatever the step (no pad row); the rows' K/V go
        to ``kv.length ..`` in order and each row gets its own mask over the bound buffer
        (``parents``: a tree fed one row per node, e.g. by the gates; the engine sends chains).
        Inputs and outputs live in reused, already bound arrays (RowFeeds): a decode step only
        writes a few numbers into them before the run."""
        if slots is not None:
            raise GenerationError("a rowwise decoder verifies chains only: it has no slot layout for trees")
        n, past = len(tokens), kv.length
        _check_room(kv, n)
        kv.ensure(past + n)
        f = self._row_feeds(n, kv.size)
        f.fill(tokens, parents, past)
        if f.embeds is not None:  # an inputs_embeds decoder
            f.embeds[:] = embeds if embeds is not None else self.embeddings(np.asarray(tokens, np.int64)[None])
        if kv.bound is not f:
            f.bind(kv.binding)
            kv.bound = f
        t0 = time.perf_counter()
        self.s.run_with_iobinding(kv.binding)
        self.last_run_s = time.perf_counter() - t0
        logits, hidden = f.logits[0], (f.hidden[0] if f.hidden is not None else None)
        return (logits.copy(), hidden.copy() if hidden is not None else None, None) if copy else (logits, hidden, None)

    def _row_feeds(self, n: int, size: int) -> "RowFeeds":
        """The reusable feeds for ``n`` rows over a buffer of ``size`` positions: kept for decode-sized
        steps (a buffer growth drops them all), made fresh for prefill chunks."""
        if size != self._feeds_size:
            self._feeds, self._feeds_size = {}, size
        f = self._feeds.get(n)
        if f is None:
            f = RowFeeds(self.c, n, size, self._outputs(n))
            if n <= RowFeeds.KEEP_ROWS:
                self._feeds[n] = f
        return f

    def _outputs(self, rows: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Logits [1, rows, V] and hidden states [1, rows, H] (None without them) as views of one
        reused array: a long prompt's chunks do not fault in fresh pages every chunk."""
        V, H = self.c.vocab_size, (self.c.hidden_size if self.has_hidden else 0)
        need = rows * (V + H)
        if self._out_buf.size < need:
            self._out_buf = np.empty(max(need, 2 * self._out_buf.size), dtype=np.float32)
        logits = self._out_buf[: rows * V].reshape(1, rows, V)
        return logits, (self._out_buf[rows * V : need].reshape(1, rows, H) if self.has_hidden else None)

    def embeddings(self, ids: np.ndarray) -> np.ndarray:
        """ids [1, N] -> inputs_embeds [1, N, H] through the embedder the decoder was opened with."""
        if self.embed is None:
            raise GenerationError("this decoder takes inputs_embeds and was opened without an embedder: pass embeds")
        return self.embed(ids)

    def _identity(self, m: int) -> np.ndarray:
        if len(self._arange) < m:
            self._arange = np.arange(max(m, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:m]

    def _run_static(
        self, feeds: dict[str, np.ndarray], kv: StaticKV, n: int, m: int, rows: int, copy: bool
    ) -> tuple[np.ndarray, np.ndarray | None, None]:
        """One forward on the in-place cache: inputs bound for the new rows only, logits and hidden
        states written straight into one reusable array, K/V rows written into the cache buffer.
        With ``copy=False`` the returned rows are views, valid until the next forward (the engine's
        hot path reads them before that; callers that keep outputs get copies)."""
        import onnxruntime as ort

        _check_room(kv, m)
        b = kv.binding
        for name, arr in feeds.items():
            b.bind_cpu_input(name, arr)
        logits, hidden = self._outputs(rows if self.sparse else m)  # sparse graphs: one row per token
        b.bind_ortvalue_output(LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        if hidden is not None:
            b.bind_ortvalue_output(self.c.hidden_output, ort.OrtValue.ortvalue_from_numpy(hidden))
        t0 = time.perf_counter()
        self.s.run_with_iobinding(b)
        self.last_run_s = time.perf_counter() - t0
        if not copy:
            return logits[0, :n], (hidden[0, :n] if hidden is not None else None), None
        return logits[0, :n].copy(), (hidden[0, :n].copy() if hidden is not None else None), None


def _check_room(kv: StaticKV, rows: int) -> None:
    """Refuse a step whose rows would not fit an in-place cache's capacity."""
    if kv.length + rows > kv.capacity:
        raise GenerationError(
            f"the KV cache holds {kv.capacity} positions and this step needs {kv.length + rows}: "
            f"use a shorter prompt or fewer new tokens, or rebuild with a larger --max-context"
        )


class RowFeeds:
    """A rowwise step's inputs and outputs for ``n`` rows over a ``size``-position buffer, as numpy
    arrays bound once as OrtValues sharing their memory: a step writes ids, positions, the write
    index and the mask rows in place, and the run writes logits and hidden states into them.

    Why by hand: binding fresh arrays per step, and allocating a fresh O(size) mask, is a visible
    share of a decode step's host time (measured: docs/runtime.md); onnxruntime's IOBinding keeps a
    bound OrtValue across runs, so reusing the same memory makes the step's host work a few writes.
    """

    KEEP_ROWS = 64  # row counts up to this keep their feeds between steps (drafts; not prefill chunks)

    def __init__(self, c: Contract, n: int, size: int, outputs: tuple[np.ndarray, np.ndarray | None]):
        self.c, self.n, self.size = c, n, size
        self.ids = np.zeros((1, n), np.int64)
        self.embeds = np.zeros((1, n, c.hidden_size), np.float32) if c.primary_input == INPUTS_EMBEDS else None
        self.pos = np.zeros((1, n), np.int64)
        self.write = np.zeros(1, np.int64)
        self.bias = np.empty((1, 1, n, size), np.float32)
        self.logits, self.hidden = outputs  # views of the decoder's reused output array
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
        primary = (INPUTS_EMBEDS, self.embeds) if self.embeds is not None else (INPUT_IDS, self.ids)
        for name, arr in (
            primary,
            (c.position_input, self.pos),
            (c.mask_input, self.bias),
            (KV_WRITE_INDEX, self.write),
        ):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        binding.bind_ortvalue_output(LOGITS, ort.OrtValue.ortvalue_from_numpy(self.logits))
        if self.hidden is not None:
            binding.bind_ortvalue_output(c.hidden_output, ort.OrtValue.ortvalue_from_numpy(self.hidden))
