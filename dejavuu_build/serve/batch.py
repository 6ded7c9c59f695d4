"""Verify several requests in one forward, each request's tokens equal to decoding it alone.

``BatchDecoder`` runs the batched flavour of a static-KV decoder (export.passes.serve_batch): one KV buffer
row per active request, all rows in one array ``[2 * layers, max_batch, kv_heads, capacity,
head_dim]`` so the active requests' rows are a contiguous prefix that is bound in place. A step
feeds each request's rows right-padded to the longest (``query_seqlens``), and every request is
fed exactly the rows the single-request decoder would feed it — a one-token step becomes two
rows, a tree's tokens sit at their period-aligned attention slots (pad slots read the root row
and exist in attention only) — so each row's logits are bit-identical to decoding that
request alone (rows are independent for any row count >= 2; ``check_exact`` measures it).

Each request is a runtime.job.Job (the engine's own step machine), so the scheduler can put
many requests' verify rows into one call and still decode each as Engine.generate would.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Sequence, TypeVar

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from ..export.passes.serve_batch import GQA_POSITIONS, PAD_INDEX, QUERY_SEQLENS, SEQLENS_K, UNPAD_INDEX
from ..runtime.job import Rows
from ..runtime.tree import NEG, step_inputs
from ..schema import INPUTS_EMBEDS
from .graph import ensure_batched

if TYPE_CHECKING:
    from ..runtime.model import Model

Owner = TypeVar("Owner")  # what holds a slot (the scheduler's Request); opaque here


class BatchUnavailable(GenerationError):
    """This decoder cannot run batched (no static KV layout, or rows not exact on this machine)."""


def batch_twin(model: Model) -> str | None:
    """The variant a batched server should load instead of ``model``'s: the static-layout twin of
    the same precision, when ``model`` is not static (e.g. the rowwise default) and the twin passed
    its gates. Batches need GroupQueryAttention's ragged rows (serve_batch); None: keep ``model``."""
    if model.contract.kv_layout == S.KV_STATIC or model.manifest is None:
        return None
    precision, _ = S.split_variant(model.variant)
    twin = model.manifest.variants.get(S.variant_name(precision, S.KV_STATIC))
    return S.variant_name(precision, S.KV_STATIC) if twin is not None and twin.passed else None


class BatchDecoder(Generic[Owner]):
    """The batched graph, its KV buffer and the slot of every active request."""

    def __init__(self, model: Model, max_batch: int, cache: Path):
        c = model.contract
        if (
            c.kv_layout != S.KV_STATIC
            or model.manifest is None
            or c.mask_kind != S.MASK_ADDITIVE_4D
            or c.mask_input is None
        ):
            raise BatchUnavailable(
                f"{model.variant} is not a static-KV build with a 4D mask: batched serving needs a "
                f"`{S.STATIC_SUFFIX}` variant (`dejavuu-build tree-decoder --kv-layouts {S.KV_STATIC}`)"
            )
        import onnxruntime as ort

        from ..runtime.session import make_session

        self.ort = ort
        self.model = model
        self.c = c
        self.mask_input: str = c.mask_input
        src = model.folder / model.manifest.variants[model.variant].file
        try:
            path = ensure_batched(src, cache)
        except OSError as e:  # read-only or full cache: serve, one request at a time
            raise BatchUnavailable(
                f"the batched graph cannot be written under {cache} "
                f"({getattr(e, 'strerror', None) or e}); make the cache writable or free disk "
                f"space to batch requests"
            ) from None
        threads = model.decoder.s.get_session_options().intra_op_num_threads
        self.s = make_session(path, threads)
        self.max_batch = max_batch
        self.capacity = c.kv_capacity
        dtype = np.float16 if c.kv_dtype == "float16" else np.float32
        self.kv_in, self.kv_out = model.decoder.kv_in, model.decoder.kv_out
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
                    else self.model.decoder.embeddings(np.asarray(r.tokens, np.int64)[None])[0]
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
        bind.bind_ortvalue_output("logits", self.ort.OrtValue.ortvalue_from_numpy(logits))
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
