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

import numpy as np


class KVCache:
    def __init__(self, names: list[str], empty: np.ndarray):
        self.names = names
        self.arrays = {n: empty for n in names}
        self.length = 0

    def feeds(self) -> dict[str, np.ndarray]:
        return self.arrays

    def commit(self, present: list[np.ndarray], n_new: int, keep: list[int]) -> None:
        """Keep the past plus new positions ``keep`` (indices into this step's nodes)."""
        L = self.length
        if keep == list(range(n_new)):
            new = [np.ascontiguousarray(a) for a in present]   # a no-op unless a pad row was cut
        elif keep == list(range(len(keep))):
            new = [np.ascontiguousarray(a[:, :, :L + len(keep)]) for a in present]
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

    def __init__(self, decoder, buffers: np.ndarray, binding):
        self.dec = decoder
        self.buf = buffers                # [2 * layers, 1, kv_heads, capacity, head_dim]
        self.binding = binding
        self.length = 0
        self.capacity = buffers.shape[3]

    def commit(self, present, n_new: int, keep: list[int]) -> None:
        """Keep the past plus this step's rows ``keep`` (slots of the step, in path order)."""
        L = self.length
        k = len(keep)
        if keep != list(range(k)):
            src = L + np.asarray(keep, dtype=np.int64)
            self.buf[:, :, :, L:L + k] = self.buf[:, :, :, src]
        self.length = L + k

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def ensure(self, positions: int) -> None:
        """The buffer holds ``positions`` already (its length is the capacity)."""

    def release(self) -> None:
        """Hand the buffers back to the decoder for the next generation."""
        if self.buf is not None:
            self.dec._free.append((self.buf, self.binding))
            self.buf = self.binding = None


class GrowingKV(StaticKV):
    """The rowwise flavour's in-place cache: StaticKV whose bound buffers ``[1, KV, L, D]`` grow.

    Why grow: the rowwise graph's attention runs over the whole bound buffer (masked beyond the
    context), so L tracks the context instead of the capacity. L stays a multiple of ``tile``
    (a multiple of the kernels' key blocks, so a step's logits do not depend on L, which the
    batched gate checks across growths) and grows by at least a quarter at a time: the copy into
    the larger buffer then costs O(1) per token amortised, and attention reads at most ~1/4 +
    one tile of masked keys. The engine reserves a generation's decode room with the prompt's
    last chunk (Engine.generate), so decode steps do not grow it at all up to DECODE_RESERVE.
    """

    def __init__(self, decoder, binding, *, tile: int, capacity: int):
        super().__init__(decoder, np.zeros((0, 1, 0, 0, 0), np.float32), binding)   # allocated by ensure()
        self.tile = tile
        self.capacity = capacity
        self.size = 0
        self.bound = None     # the decoder's RowFeeds last bound to this binding (rebound when it changes)

    def ensure(self, positions: int) -> None:
        if positions <= self.size:
            return
        import onnxruntime as ort

        size = min(self.capacity, -(-max(positions, self.size + self.size // 4) // self.tile) * self.tile)
        c = self.dec.c
        dtype = np.float16 if c.kv_dtype == "float16" else np.float32
        buf = np.zeros((len(self.dec.kv_in), 1, c.num_kv_heads, size, c.head_dim), dtype=dtype)
        if self.length:
            buf[:, :, :, :self.length] = self.buf[:, :, :, :self.length]
        for j, (i_name, o_name) in enumerate(zip(self.dec.kv_in, self.dec.kv_out)):
            v = ort.OrtValue.ortvalue_from_numpy(buf[j])
            self.binding.bind_ortvalue_input(i_name, v)
            self.binding.bind_ortvalue_output(o_name, v)
        self.buf, self.size = buf, size
