"""The KV cache of committed tokens.

The decoder graph returns ``present = concat(past, new)`` for every layer. After a verify step
we keep the committed tokens only:
- every new token accepted (plain decoding, a fully accepted chain): ``present`` is adopted as
  is, no copy;
- a chain accepted up to k < n: a prefix of ``present`` (one contiguous copy per layer);
- a tree: the past plus the accepted nodes gathered in path order (one copy per layer).
Each step therefore costs one O(length) copy at most, the same order as the concat the graph
itself does; nothing is re-copied twice and nothing grows quadratically per step.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, Union

import numpy as np

from ..errors import GenerationError
from ..schema import Contract


class BufferOwner(Protocol):
    """What a cache reads of the decoder that made it (runtime.decoder.Decoder, which imports this
    module): the graph's contract and KV names, and where a finished cache's buffers go back."""

    @property
    def c(self) -> Contract: ...

    @property
    def kv_in(self) -> Sequence[str]: ...

    @property
    def kv_out(self) -> Sequence[str]: ...

    def reclaim(self, buffers: np.ndarray, binding: Any) -> None: ...


class KVCache:
    def __init__(self, names: list[str], empty: np.ndarray):
        self.names = names
        self.arrays = {n: empty for n in names}
        self.length = 0

    def feeds(self) -> dict[str, np.ndarray]:
        return self.arrays

    def commit(self, present: list[np.ndarray] | None, n_new: int, keep: list[int]) -> None:
        """Keep the past plus new positions ``keep`` (indices into this step's nodes)."""
        if present is None:
            raise GenerationError("a concat KV cache keeps the graph's present outputs, and this step returned none")
        L = self.length
        if keep == list(range(n_new)):
            new = [np.ascontiguousarray(a) for a in present]  # a no-op unless a pad row was cut
        elif keep == list(range(len(keep))):
            new = [np.ascontiguousarray(a[:, :, : L + len(keep)]) for a in present]
        else:
            idx = np.concatenate([np.arange(L), L + np.asarray(keep, dtype=np.int64)])
            new = [np.take(a, idx, axis=2) for a in present]
        self.arrays = dict(zip(self.names, new))
        self.length = L + len(keep)

    def ensure(self, positions: int) -> None:
        """Nothing to reserve: the graph returns past + new."""

    def truncate(self, length: int) -> None:
        if length < self.length:
            self.arrays = {n: np.ascontiguousarray(a[:, :, :length]) for n, a in self.arrays.items()}
            self.length = length

    def release(self) -> None:
        """Nothing to hand back (the arrays are the graph's own outputs); StaticKV has buffers."""


class StaticKV:
    """The in-place KV cache of a static-layout decoder: one preallocated buffer per layer's K and
    V, bound through I/O binding as both the graph's ``past`` and ``present`` input/output.

    The graph writes a step's rows at ``length ..`` itself, so nothing is copied per step: a chain
    accepted up to k rows just moves ``length`` (rows beyond it are ignored next step and then
    overwritten), and a tree moves only its accepted nodes' rows into place. All layers live in
    one array so that move is a single numpy operation, whatever the layer count.
    """

    def __init__(self, decoder: BufferOwner, buffers: np.ndarray, binding: Any):
        self.dec = decoder
        self.buf: np.ndarray | None = buffers  # [2 * layers, 1, kv_heads, capacity, head_dim]; None once released
        self.binding: Any = binding  # an onnxruntime IOBinding
        self.length = 0
        self.capacity = buffers.shape[3]

    def buffers(self) -> np.ndarray:
        """The bound buffer; a released cache refuses to be used again."""
        if self.buf is None:
            raise GenerationError("this KV cache was released: start a new one with Decoder.new_cache()")
        return self.buf

    def commit(self, present: list[np.ndarray] | None, n_new: int, keep: list[int]) -> None:
        """Keep the past plus this step's rows ``keep`` (slots of the step, in path order); ``present``
        is unused: the graph wrote the rows into the buffer itself."""
        L = self.length
        k = len(keep)
        if keep != list(range(k)):
            buf = self.buffers()
            src = L + np.asarray(keep, dtype=np.int64)
            buf[:, :, :, L : L + k] = buf[:, :, :, src]
        self.length = L + k

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def ensure(self, positions: int) -> None:
        """The buffer holds ``positions`` already (its length is the capacity)."""

    def release(self) -> None:
        """Hand the buffers back to the decoder for the next generation."""
        if self.buf is not None:
            self.dec.reclaim(self.buf, self.binding)
            self.buf = self.binding = None


def round_up(n: int, tile: int) -> int:
    """``n`` rounded up to a whole number of ``tile``: the rowwise buffer's lengths (GrowingKV and
    the gates' runner bind the same ones)."""
    return -(-n // tile) * tile


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
    masked, at every step. Growth steps are sized as ``tile * isqrt(L / (4 tile))``: a copy's cost
    grows with L, a step's masked tail with the step.
    ``mem`` (with the binding) is reused by the next request, starting small again.
    """

    def __init__(self, decoder: BufferOwner, binding: Any, *, tile: int, capacity: int, mem: np.ndarray | None = None):
        c = decoder.c
        if mem is None:
            dtype = np.float16 if c.kv_dtype == "float16" else np.float32
            mem = np.zeros((len(decoder.kv_in), c.num_kv_heads * capacity * c.head_dim), dtype=dtype)
        self.mem = mem
        self.dec = decoder
        super().__init__(decoder, self._view(0), binding)
        self.tile = tile
        self.capacity = capacity
        self.size = 0
        self.bound: Any = None  # the decoder's RowFeeds last bound to this binding (rebound when it changes)

    def _view(self, size: int) -> np.ndarray:
        """The first ``size`` positions' layout: [2 * layers, 1, KV, size, D], a view of ``mem``."""
        c = self.dec.c
        return self.mem[:, : c.num_kv_heads * size * c.head_dim].reshape(
            len(self.mem), 1, c.num_kv_heads, size, c.head_dim
        )

    def step(self, positions: int) -> int:
        """How far the buffer grows past ``positions``: ``tile * isqrt(positions / (4 tile))``."""
        import math

        return self.tile * max(1, math.isqrt(positions // (4 * self.tile)))

    def reserve(self, prompt: int, decode: int) -> None:
        """Before the prompt's last chunk: room for the prompt and as much of the decoding as one
        growth step would give, so short generations never grow (a one-chunk prompt: nothing to
        move yet). Earlier chunks grow the buffer as they go: a chunk attends to the whole buffer,
        so reserving the prompt's full length up front slows a long prefill (docs/runtime.md)."""
        self.ensure(min(self.capacity, prompt + min(decode, self.step(prompt))))

    def ensure(self, positions: int) -> None:
        if positions <= self.size:
            return
        import onnxruntime as ort

        t = self.tile
        size = min(self.capacity, round_up(max(positions, self.size + self.step(max(positions, self.size))), t))
        old, new = self.buffers(), self._view(size)
        for h in range(self.dec.c.num_kv_heads - 1, 0, -1):  # later heads first: nothing is overwritten unread
            new[:, :, h, : self.length] = old[:, :, h, : self.length]
        for j, (i_name, o_name) in enumerate(zip(self.dec.kv_in, self.dec.kv_out)):
            v = ort.OrtValue.ortvalue_from_numpy(new[j])
            self.binding.bind_ortvalue_input(i_name, v)
            self.binding.bind_ortvalue_output(o_name, v)
        self.buf, self.size = new, size

    def release(self) -> None:
        if self.binding is not None:
            self.dec.reclaim(self.mem, self.binding)
            self.buf = self.binding = None


Cache = Union[KVCache, StaticKV]  # what Decoder.new_cache returns (GrowingKV is a StaticKV)
