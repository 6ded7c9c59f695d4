"""The static KV layout: one ``com.microsoft.GroupQueryAttention`` per layer over a preallocated
``[1, kv_heads, capacity, head_dim]`` buffer, bound through I/O binding as both past and present
(export.passes.static_kv), so a step writes its new rows only.

GroupQueryAttention's lone row differs from its multi-row one, so the graph runs every GQA on at
least two query rows itself (static_kv's floor: a zero row after a lone one) and a lone token is
one graph row wherever the graph is length-invariant (its other ops probed and guarded like any
layout's: build.row_guard); a graph built before the floor has no such record, and the runtime
pads its lone tokens to two rows (PaddedDriver). The floor's extra row is written one position
past the context, so a step keeps that position free (``run_step``). A tree comes in its aligned
slot layout; the graph takes the slots as two index inputs (``slot_rows``, ``row_slots``:
``sparse``), so pad slots cost attention only. Its batched serving graph
(export.passes.serve_batch) is driven by ``StaticBatch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from ..runtime.tree import NEG, step_inputs
from .base import (
    BatchDriver,
    Host,
    Layout,
    Out,
    Owner,
    PaddedDriver,
    Rows,
    bind_kv,
    check_room,
    kv_dtype,
    kv_zeros,
)


class StaticKV:
    """The in-place KV cache of a static-layout decoder: one preallocated buffer per layer's K and
    V, bound through I/O binding as both the graph's ``past`` and ``present`` input/output.

    The graph writes a step's rows at ``length ..`` itself, so nothing is copied per step: a chain
    accepted up to k rows just moves ``length`` (rows beyond it are ignored next step and then
    overwritten), and a tree moves only its accepted nodes' rows into place. All layers live in
    one array so that move is a single numpy operation, whatever the layer count.
    """

    def __init__(self, driver: Any, buffers: np.ndarray, binding: Any):
        self.dec = driver  # the Driver whose reclaim() takes the buffers back
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
        """Hand the buffers back to the driver for the next generation."""
        if self.buf is not None:
            self.dec.reclaim(self.buf, self.binding)
            self.buf = self.binding = None


class StaticDriver(PaddedDriver):
    """Inputs bound for the new rows only, logits and hidden states written straight into one
    reusable array, K/V rows written by the graph into the cache's bound buffer."""

    def __init__(self, dec: Host):
        super().__init__(dec)
        # rows decoupled from attention slots (export.passes.static_kv): pad slots cost attention only
        self.sparse = S.SLOT_ROWS in {i.name for i in dec.s.get_inputs()}

    def new_cache(self) -> StaticKV:
        if self.free:
            buf, binding = self.free.pop()
        else:
            # pages touched lazily (base.kv_zeros): a long capacity costs memory only as the context grows
            c = self.c
            buf = kv_zeros((len(self.kv_in), 1, c.num_kv_heads, c.kv_capacity, c.head_dim), kv_dtype(c))
            binding = self.dec.s.io_binding()
            bind_kv(binding, self.kv_in, self.kv_out, buf)
        return StaticKV(self, buf, binding)

    def empty_past(self) -> dict[str, np.ndarray]:
        """The whole zeroed buffer: the gates feed it as the past."""
        c = self.c
        z = np.zeros((1, c.num_kv_heads, c.kv_capacity, c.head_dim), dtype=np.float32)
        return dict.fromkeys(self.kv_in, z)

    def past_inputs(self, kv: Any) -> dict[str, np.ndarray]:
        assert isinstance(kv, StaticKV), "a static decoder's cache comes from its new_cache()"
        return {}  # bound once, as past and present

    def run_step(
        self, feeds: dict[str, np.ndarray], kv: Any, n: int, m: int, rows: int, copy: bool, pad: bool, start: int
    ) -> Out:
        """With ``copy=False`` the returned rows are views, valid until the next forward (the
        engine's hot path reads them before that; callers that keep outputs get copies)."""
        import onnxruntime as ort

        check_room(kv, max(m, S.GQA_MIN_ROWS))  # a lone row's floor row is written after it
        b = kv.binding
        for name, arr in feeds.items():
            b.bind_cpu_input(name, arr)
        logits, hidden = self.outputs(rows if self.sparse else m, start)  # sparse graphs: one row per token
        b.bind_ortvalue_output(S.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
        if hidden is not None:
            b.bind_ortvalue_output(self.c.hidden_output, ort.OrtValue.ortvalue_from_numpy(hidden))
        self.run_bound(b)
        if not copy:
            return logits[0, : n - start], (hidden[0, :n] if hidden is not None else None), None
        return logits[0, : n - start].copy(), (hidden[0, :n].copy() if hidden is not None else None), None


class StaticBatch(BatchDriver[Owner]):
    """A static variant's batched graph (export.passes.serve_batch): one KV buffer row per active
    request, all rows in one array ``[2 * layers, max_batch, kv_heads, capacity, head_dim]``. A step
    feeds each request's rows right-padded to the longest (``query_seqlens``; one with less KV room
    than that runs in a further, narrower forward), the rows
    StaticDriver would feed it alone -- a one-token step is one row in two attention slots, as the
    single graph's floor runs it, a tree's tokens sit at their period-aligned attention slots (pad
    slots read the root row and exist in attention only) -- so each row's logits are bit-identical
    to decoding that request alone (GroupQueryAttention's rows are independent for any row count
    >= 2, the other ops' for any row count where the graph is length-invariant)."""

    def __init__(self, decoder: Host, path: Path, max_batch: int, threads: int):
        super().__init__(decoder, path, max_batch, threads)
        c = self.c
        # pages touched lazily (base.kv_zeros): memory grows with the contexts actually held
        self.buf = kv_zeros((len(self.kv_in), max_batch, c.num_kv_heads, self.capacity, c.head_dim), kv_dtype(c))

    def forward(self, lo: int, rows: Sequence[Rows | None]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        fed: list[Rows | None] = []
        for r in rows:
            if r is not None and len(r.tokens) == 1 and r.slots is None:
                # as the single graph's floor: one row, two attention slots (the second a pad slot,
                # masked for the row, its K/V written past the context); the batched graph has no floor
                r = Rows(r.tokens, [-1] * S.GQA_MIN_ROWS, r.embeds, slots=[0])
            fed.append(r)
        widths = [
            0 if r is None else len(r.parents) if r.slots is not None and r.parents is not None else len(r.tokens)
            for r in fed
        ]
        lens = [self.lengths[lo + b] for b in range(len(fed))]
        for b, r in enumerate(fed):
            if r is not None and lens[b] + max(S.GQA_MIN_ROWS, widths[b]) > self.capacity:
                raise GenerationError(
                    f"the KV cache holds {self.capacity} positions and this step needs "
                    f"{lens[b] + max(S.GQA_MIN_ROWS, widths[b])}: use a shorter prompt or fewer new tokens"
                )
        # Every entry is padded to the step's widest (W attention slots) and a padded entry writes W
        # K/V slots past its context, so a request with less room than W (near the cache's end, beside
        # one verifying a long chain or a tree) runs in a further forward of narrower entries instead
        # of failing its batch-mates or being cut; its rows, and so its tokens, are those of any width.
        idle = np.empty((0, self.c.vocab_size), np.float32)
        no_hidden = None if self.c.hidden_output is None else np.empty((0, self.c.hidden_size), np.float32)
        out: list[tuple[np.ndarray, np.ndarray | None]] = [(idle, no_hidden)] * len(fed)
        pending = [b for b, r in enumerate(fed) if r is not None]
        calls, run_s = 0, 0.0
        while pending:  # ends: the widest pending entry always fits its own width (checked above)
            W = max([S.GQA_MIN_ROWS] + [widths[b] for b in pending])
            now = [b for b in pending if lens[b] + W <= self.capacity]
            part = [fed[b] if b in now else None for b in range(len(fed))]
            for b, res in enumerate(self._forward(lo, part, widths, lens, W)):
                if b in now:
                    out[b] = res
            run_s += self.last_run_s
            pending = [b for b in pending if b not in now]
            calls += 1
        self.last_run_s = run_s
        self.split_forwards += calls > 1
        return out

    def _forward(
        self,
        lo: int,
        fed: Sequence[Rows | None],
        widths: Sequence[int],
        lens: Sequence[int],
        W: int,
    ) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """One onnxruntime call over the entries of ``fed`` that are not None, each padded to ``W``
        attention slots (the caller checked they fit); per entry its tokens' outputs (none for an
        idle one; a lone token's pad slot exists in attention only)."""
        B = len(fed)
        width = max(1, max(lens[b] + widths[b] for b in range(B) if fed[b] is not None))
        counts = [len(r.tokens) if r is not None else 0 for r in fed]
        T = sum(counts)
        ids = np.zeros((1, T), np.int64)
        pos = np.zeros((B, W), np.int64)
        pad_index = np.zeros((B, W), np.int64)
        unpad_index = np.zeros((1, T), np.int64)
        bias = np.full((B, 1, W, width), NEG, np.float32)
        seqlens = np.zeros(B, np.int32)
        qlens = np.zeros(B, np.int32)
        embeds = np.zeros((1, T, self.c.hidden_size), np.float32) if self.c.primary_input == S.INPUTS_EMBEDS else None
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        for b, r in enumerate(fed):
            P = lens[b]
            pos[b] = P
            if r is None:
                # idle: query_seqlens 0 writes nothing, and one cached position (not P) keeps
                # onnxruntime from asking room for W slots past P, which a full entry may not have
                continue
            n, o, w = counts[b], int(offsets[b]), widths[b]
            parents = r.parents if r.parents is not None else list(range(-1, n - 1))
            slots = np.arange(n) if r.slots is None else np.asarray(r.slots, np.int64)
            p, m = step_inputs(parents, P)
            ids[0, o : o + n] = r.tokens
            pos[b, :w] = p[0]
            pad_index[b, :w] = o  # pad slots read the root row (their keys are masked)
            pad_index[b, slots] = o + np.arange(n)
            unpad_index[0, o : o + n] = b * W + slots
            bias[b, 0, :w, : P + w] = m[0, 0]
            seqlens[b], qlens[b] = P + w - 1, w
            if embeds is not None:
                embeds[0, o : o + n] = self.embeddings(r)
        bind = self.binding(lo, lo + B)
        feeds = {
            S.GQA_POSITIONS: pos,
            self.mask_input: bias,
            S.SEQLENS_K: seqlens,
            S.QUERY_SEQLENS: qlens,
            S.PAD_INDEX: pad_index,
            S.UNPAD_INDEX: unpad_index,
        }
        feeds[self.c.primary_input] = embeds if embeds is not None else ids
        for name, arr in feeds.items():
            bind.bind_cpu_input(name, arr)
        logits, hidden = self.bind_outputs(bind, (1, T))
        self.run_bound(bind)
        return [
            (logits[0, o : o + n], hidden[0, o : o + n] if hidden is not None else None)
            for o, n in zip(offsets.tolist(), counts)
        ]


def _graph_pass(proto: Any, capacity: int) -> Any:
    from ..export.passes.static_kv import to_static_kv  # onnx: loaded only by a build that writes it

    return to_static_kv(proto, capacity)


def _batch_pass(proto: Any, source: str) -> Any:
    from ..export.passes.serve_batch import to_serve_batch

    return to_serve_batch(proto, source)


LAYOUT = Layout(
    S.KV_STATIC,
    rank=0,
    in_place=True,
    driver=StaticDriver,
    step="static KV flavour of {p} (GroupQueryAttention, capacity {c})",
    graph_pass=_graph_pass,
    optional=False,
    batch_pass=_batch_pass,
    batch_driver=StaticBatch,
)
