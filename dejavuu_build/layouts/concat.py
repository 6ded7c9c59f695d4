"""The concat KV layout: present = past + new, the exported graph itself (what other runtimes load).

Its cache (``KVCache``) holds the graph's present arrays. After a verify step we keep the committed
tokens only:
- every new token accepted (plain decoding, a fully accepted chain): ``present`` is adopted as
  is, no copy;
- a chain accepted up to k < n: a prefix of ``present`` (one contiguous copy per layer);
- a tree: the past plus the accepted nodes gathered in path order (one copy per layer).
Each step therefore costs one O(length) copy at most, the same order as the concat the graph
itself does; nothing is re-copied twice and nothing grows quadratically per step.
It has no graph pass and no batched serving graph of its own: a concat default's server batches
on its static twin's (``batch``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from .base import Layout, Out, PaddedDriver, kv_dtype


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


class ConcatDriver(PaddedDriver):
    """The past fed as arrays, the present returned and kept by the cache (a pad row's cut)."""

    def new_cache(self) -> KVCache:
        c = self.c
        return KVCache(self.kv_in, np.zeros((1, c.num_kv_heads, 0, c.head_dim), dtype=kv_dtype(c)))

    def past_inputs(self, kv: Any) -> dict[str, np.ndarray]:
        assert isinstance(kv, KVCache), "a concat decoder's cache comes from its new_cache()"
        return dict(kv.feeds())

    def run_step(
        self, feeds: dict[str, np.ndarray], kv: Any, n: int, m: int, rows: int, copy: bool, pad: bool, start: int
    ) -> Out:
        past = kv.length
        names = [S.LOGITS] + ([S.HIDDEN_STATES] if self.dec.has_hidden else []) + self.kv_out
        out = self.run(names, feeds)
        logits = out[0][0][: n - start]
        hidden = out[1][0][:n] if self.dec.has_hidden else None
        present = out[2:] if self.dec.has_hidden else out[1:]
        if pad:
            present = [a[:, :, : past + 1] for a in present]
        return logits, hidden, present


LAYOUT = Layout(S.KV_CONCAT, rank=2, in_place=False, driver=ConcatDriver)
