"""Verify several requests in one forward, each request's tokens equal to decoding it alone.

``BatchDecoder`` runs the batched flavour of a static-KV decoder (serve.graph): one KV buffer
row per active request, all rows in one array ``[2 * layers, max_batch, kv_heads, capacity,
head_dim]`` so the active requests' rows are a contiguous prefix that is bound in place. A step
feeds each request's rows right-padded to the longest (``query_seqlens``), and every request is
fed exactly the rows the single-request decoder would feed it — a one-token step becomes two
rows, a tree its period-aligned slots — so each row's logits are bit-identical to decoding that
request alone (rows are independent for any row count >= 2; ``check_exact`` measures it).

``Job`` is one request as a step machine: the draft -> verify -> accept loop of
runtime.engine.Engine cut at the forward, so the scheduler can put many jobs' verify rows into
one call. It reuses the engine's acceptance, truncation and tree layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import GenerationError
from ..log import logger
from ..runtime.drafters.base import Draft, DraftBudget, Drafter, Feedback
from ..runtime.engine import PREFILL_CHUNK, Engine, GenerationStats, _topk_rows, tree_layout
from ..runtime.sampling import Sampler, residual
from ..runtime.tree import NEG, slot_tokens, step_inputs, with_root
from .graph import (GQA_POSITIONS, PAD_INDEX, QUERY_SEQLENS, SEQLENS_K, UNPAD_INDEX, batched_graph,
                    batched_path)


class BatchUnavailable(GenerationError):
    """This decoder cannot run batched (no static KV layout, or rows not exact on this machine)."""


@dataclass
class Rows:
    """What one request feeds a forward: graph rows (tokens, parents per row or None for a chain)
    and, for inputs_embeds decoders, the rows' embeddings."""

    tokens: list[int]
    parents: list[int] | None
    embeds: np.ndarray | None = None     # [rows, hidden]


class BatchDecoder:
    """The batched graph, its KV buffer and the slot of every active request."""

    def __init__(self, model, max_batch: int, cache: Path):
        c = model.contract
        if c.kv_layout != "static" or model.manifest is None or c.mask_kind != "additive_4d":
            raise BatchUnavailable(f"{model.variant} is not a static-KV build with a 4D mask: batched serving needs a "
                                   f"`-static` variant (`dejavuu-build tree-decoder --kv-layouts static`)")
        import onnxruntime as ort

        from ..runtime.session import make_session

        self.ort = ort
        self.model = model
        self.c = c
        src = model.folder / model.manifest.variants[model.variant].file
        path = batched_path(src, cache)
        if not path.is_file():
            logger.info("writing the batched flavour of %s to %s", src.name, path)
            batched_graph(src, path)
        threads = model.decoder.s.get_session_options().intra_op_num_threads
        self.s = make_session(path, threads)
        self.max_batch = max_batch
        self.capacity = c.kv_capacity
        dtype = np.float16 if c.kv_dtype == "float16" else np.float32
        self.kv_in, self.kv_out = model.decoder.kv_in, model.decoder.kv_out
        # np.zeros maps pages lazily: memory grows with the contexts actually held.
        self.buf = np.zeros((len(self.kv_in), max_batch, c.num_kv_heads, self.capacity, c.head_dim), dtype=dtype)
        self.lengths = [0] * max_batch
        self.active = 0                       # slots [0, active) are in use
        self.owners: list[object | None] = [None] * max_batch
        self._bindings: dict[tuple[int, int], object] = {}
        self.last_run_s = 0.0

    # ------------------------------------------------------------------ slots
    def acquire(self, owner) -> int:
        if self.active >= self.max_batch:
            raise GenerationError("no free batch slot")
        i = self.active
        self.active += 1
        self.owners[i], self.lengths[i] = owner, 0
        return i

    def release(self, slot: int) -> object | None:
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

    def _binding(self, lo: int, hi: int):
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
    def forward(self, lo: int, rows: Sequence[Rows | None]):
        """One forward over slots ``lo .. lo+len(rows)``; ``None`` marks an idle slot. Returns per
        slot (logits [n, V], hidden [n, H] or None) for its real rows (copies), and commits nothing:
        the caller moves each slot's length with :meth:`commit`."""
        B = len(rows)
        fed = []
        for r in rows:
            if r is not None and len(r.tokens) == 1:   # as Decoder.forward: one token -> two rows
                r = Rows(r.tokens * 2, [-1, -1], None if r.embeds is None else np.concatenate([r.embeds] * 2))
            fed.append(r)
        S = max([2] + [len(r.tokens) for r in fed if r is not None])
        lens = [self.lengths[lo + b] for b in range(B)]
        for b, r in enumerate(fed):
            if r is not None and lens[b] + S > self.capacity:
                raise GenerationError(f"the KV cache holds {self.capacity} positions and this step needs "
                                      f"{lens[b] + S}: use a shorter prompt or fewer new tokens")
        width = max(1, max(lens[b] + (len(r.tokens) if r is not None else 0) for b, r in enumerate(fed)))
        counts = [len(r.tokens) if r is not None else 0 for r in fed]
        T = sum(counts)
        ids = np.zeros((1, T), np.int64)
        pos = np.zeros((B, S), np.int64)
        pad_index = np.zeros((B, S), np.int64)
        unpad_index = np.zeros((1, T), np.int64)
        bias = np.full((B, 1, S, width), NEG, np.float32)
        seqlens = np.zeros(B, np.int32)
        qlens = np.zeros(B, np.int32)
        embeds = np.zeros((1, T, self.c.hidden_size), np.float32) if self.c.primary_input == "inputs_embeds" else None
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        for b, r in enumerate(fed):
            P = lens[b]
            pos[b] = P
            if r is None:
                seqlens[b] = max(P - 1, 0)
                continue
            n, o = counts[b], int(offsets[b])
            parents = r.parents if r.parents is not None else list(range(-1, n - 1))
            p, m = step_inputs(parents, P)
            ids[0, o:o + n] = r.tokens
            pos[b, :n] = p[0]
            pad_index[b, :n] = np.arange(o, o + n)
            unpad_index[0, o:o + n] = b * S + np.arange(n)
            bias[b, 0, :n, :P + n] = m[0, 0]
            seqlens[b], qlens[b] = P + n - 1, n
            if embeds is not None:
                embeds[0, o:o + n] = r.embeds if r.embeds is not None else self.model.decoder.embed(
                    np.asarray(r.tokens, np.int64)[None])[0]
        bind = self._binding(lo, lo + B)
        feeds = {GQA_POSITIONS: pos, self.c.mask_input: bias, SEQLENS_K: seqlens, QUERY_SEQLENS: qlens,
                 PAD_INDEX: pad_index, UNPAD_INDEX: unpad_index}
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
            if r is None:
                out.append((None, None))
                continue
            o, n = int(offsets[b]), len(r.tokens)
            out.append((logits[0, o:o + n], hidden[0, o:o + n] if hidden is not None else None))
        return out

    def commit(self, slot: int, n_rows: int, keep: list[int]) -> None:
        """Keep this step's rows ``keep`` of ``slot`` (as StaticKV.commit)."""
        L = self.lengths[slot]
        k = len(keep)
        if keep != list(range(k)):
            src = L + np.asarray(keep, dtype=np.int64)
            rows = self.buf[:, slot]          # a view: [2 * layers, kv_heads, capacity, head_dim]
            rows[:, :, L:L + k] = rows[:, :, src]
        self.lengths[slot] = L + k


class Job:
    """One request's decoding as a step machine (Engine.generate cut at each forward)."""

    def __init__(self, ids: list[int], *, drafter: Drafter, sampler: Sampler, max_new_tokens: int,
                 budget: DraftBudget, period: int | None, tile: int | None, eos_ids: Sequence[int] = (),
                 should_stop: Callable[[list[int]], int | None] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, prefill_embeds: np.ndarray | None = None,
                 capacity: int = 0):
        self.tokens = [int(t) for t in ids]
        self.prompt_len = len(self.tokens)
        self.drafter, self.sampler, self.max_new = drafter, sampler, max_new_tokens
        self.budget, self.period, self.tile = budget, period, tile
        self.eos = set(int(e) for e in eos_ids)
        self.should_stop, self.on_tokens = should_stop, on_tokens
        self.prefill_embeds = prefill_embeds
        self.capacity = capacity
        self.new: list[int] = []
        self.reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(self.tokens))
        self.t_start = time.perf_counter()
        self.prefilled = 0
        self._step: tuple | None = None
        self._draft_dt = 0.0
        drafter.begin(self.tokens)

    @property
    def done(self) -> bool:
        return self.reason is not None

    # ------------------------------------------------------------------ prefill
    def prefill_rows(self) -> Rows:
        """The next prompt chunk (the engine's PREFILL_CHUNK boundaries, so rows match exactly)."""
        i = self.prefilled
        part = self.tokens[i:i + PREFILL_CHUNK]
        emb = None if self.prefill_embeds is None else self.prefill_embeds[0, i:i + PREFILL_CHUNK]
        return Rows(part, None, emb)

    def after_prefill(self, batch: BatchDecoder, slot: int, logits, hidden) -> None:
        n = len(self.prefill_rows().tokens)
        batch.commit(slot, n, list(range(n)))
        self.prefilled += n
        if self.prefilled < self.prompt_len:
            return
        first = self.sampler.pick(logits[-1], self.prompt_len)
        self.stats.prefill_s = time.perf_counter() - self.t_start
        self.new.append(first)
        self.tokens.append(first)
        d = self.drafter
        d.feedback(Feedback(committed=[first], drafted=0, accepted=0,
                            topk_ids=_topk_rows(logits[-1:], 8) if d.wants_topk else None,
                            hidden=hidden[-1:].copy() if d.wants_hidden and hidden is not None else None))
        if self.on_tokens:
            self.on_tokens([first])
        _, self.reason = Engine._truncate([], [first], self.eos, self.max_new, self.should_stop)
        if self.reason:
            self._finish()

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_len

    # ------------------------------------------------------------------ decode steps
    def plan(self, kv_length: int) -> Rows:
        """Draft, validate and lay out this step's rows (the engine's loop body up to the forward)."""
        remaining = self.max_new - len(self.new)
        bud = self.budget
        b = DraftBudget(min(bud.max_nodes, 8 * remaining), min(bud.max_depth, remaining - 1), bud.width, bud.tree)
        t1 = time.perf_counter()
        draft = self.drafter.propose(self.tokens, b) if b.max_depth > 0 else Draft()
        self._draft_dt = time.perf_counter() - t1
        self.stats.draft_s += self._draft_dt
        try:
            draft.validate()
            draft = draft.within(b)
            draft.validate(b)
        except (ValueError, TypeError, AttributeError) as e:
            raise GenerationError(f"drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)!r} proposed "
                                  f"an invalid draft: {e}") from None
        step_tokens = [self.tokens[-1]] + draft.tokens
        parents = with_root(draft.parents)
        if draft.is_chain():
            slots, n_slots = list(range(len(step_tokens))), len(step_tokens)
            self._step = (draft, step_tokens, parents, slots, n_slots, None)
            return Rows(step_tokens, None)
        draft, step_tokens, parents, slot, slot_parents = tree_layout(
            draft, step_tokens, parents, period=self.period, tile=self.tile, width=b.width,
            capacity=self.capacity, past=kv_length)
        self._step = (draft, step_tokens, parents, slot, len(slot_parents), slot)
        return Rows(slot_tokens(step_tokens, slot, len(slot_parents)), slot_parents)

    def after_step(self, batch: BatchDecoder, slot_index: int, logits_s, hidden_s, verify_s: float,
                   forward_s: float) -> None:
        draft, step_tokens, parents, slots, n_slots, tree_slot = self._step
        logits = logits_s[tree_slot] if tree_slot is not None else logits_s
        hidden = None
        if hidden_s is not None:
            hidden = hidden_s[tree_slot] if tree_slot is not None else hidden_s
        t3 = time.perf_counter()
        st = self.stats
        st.verify_s += verify_s
        st.forward_s += forward_s
        committed, path = Engine._accept(step_tokens, parents, draft, logits, self.sampler, len(self.tokens), residual)
        batch.commit(slot_index, n_slots, [slots[i] for i in path])
        st.kv_s += time.perf_counter() - t3
        st.steps += 1
        st.drafted += len(draft)
        st.accepted += len(path) - 1
        st.accept_hist.append(len(path) - 1)
        committed, self.reason = Engine._truncate(self.new, committed, self.eos, self.max_new, self.should_stop)
        self.tokens += committed
        self.new += committed
        if self.on_tokens and committed:
            self.on_tokens(committed)
        d = self.drafter
        d.feedback(Feedback(committed=committed, drafted=len(draft), accepted=len(path) - 1,
                            accepted_path=[i - 1 for i in path[1:]],
                            topk_ids=_topk_rows(logits, 8) if d.wants_topk else None,
                            hidden=hidden[path] if d.wants_hidden and hidden is not None else None,
                            draft_seconds=self._draft_dt, verify_seconds=verify_s))
        self._step = None
        if self.reason:
            self._finish()

    def _finish(self) -> None:
        self.drafter.end()
        st = self.stats
        st.tokens = len(self.new)
        st.total_s = time.perf_counter() - self.t_start
        st.overhead_s = max(0.0, st.total_s - st.prefill_s - st.draft_s - st.verify_s)
