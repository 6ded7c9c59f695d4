"""The speculative decoding loop: prefill, then per step draft -> one forward -> accept -> keep KV.

Lossless by construction: at every position the committed token is the target's own choice
(argmax, or a draw seeded by the absolute position); drafts only decide how many of those
choices one forward pass can confirm. Drafters with real probabilities use min(1, p/q).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..errors import GenerationError
from ..schema import KV_WRITE_INDEX, LOGITS, ROW_SLOTS, SLOT_ROWS, Contract, in_place
from .drafters.base import Draft, DraftBudget, Drafter, Feedback
from .kv import Cache, GrowingKV, KVCache, StaticKV
from .sampling import Sampler, accept_ratio, residual
from .tree import NEG, aligned_layout, causal_inputs, row_bias, slot_tokens, step_inputs, with_root

ROWWISE_TILE = 64    # the rowwise buffer grows in multiples of this many positions (GrowingKV)

ResidualFn = Callable[[np.ndarray, np.ndarray], np.ndarray]   # sampling.residual's signature
StopFn = Callable[[list[int]], "int | None"]    # generated ids -> the prefix length that ends at a stop string


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    forward_s: float = 0.0      # decode steps' time inside onnxruntime's run (prefill excluded)
    kv_s: float = 0.0
    overhead_s: float = 0.0
    total_s: float = 0.0
    accept_hist: list[int] = field(default_factory=list)   # accepted draft tokens per step
    filled: int = 0             # steps whose empty draft took the pad row's place (Engine ``fill``)
    fill_accepted: int = 0      # ... and whose filled token was accepted

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per verify step."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        """New tokens per verify step (accepted + the bonus token): the speedup's upper bound."""
        return (self.tokens - 1) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def host_ms_per_step(self) -> float:
        """Decode time per step spent outside the forward (drafting, masks, KV moves, sampling)."""
        return 1e3 * (self.decode_s - self.forward_s) / self.steps if self.steps else 0.0

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 and self.tokens > 1 else 0.0

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("accept_hist")
        d.update(mean_accepted=round(self.mean_accepted, 3), tokens_per_step=round(self.tokens_per_step, 3),
                 acceptance_rate=round(self.acceptance_rate, 3), decode_tok_s=round(self.decode_tok_s, 2),
                 host_ms_per_step=round(self.host_ms_per_step, 4))
        for k, v in list(d.items()):
            if isinstance(v, float):
                d[k] = round(v, 5)
        return d


class Decoder:
    """One ORT decoder session driven through its (derived) contract."""

    def __init__(self, session: Any, contract: Contract, embed: Callable[[np.ndarray], np.ndarray] | None = None):
        self.s = session
        self.c = contract
        self.embed = embed
        self.out_names = [o.name for o in session.get_outputs()]
        self.kv_in = [contract.kv_input_pattern.format(i=i, kv=kv)
                      for i in range(contract.num_layers) for kv in ("key", "value")]
        self.kv_out = [contract.kv_output_pattern.format(i=i, kv=kv)
                       for i in range(contract.num_layers) for kv in ("key", "value")]
        self.has_hidden = contract.hidden_output is not None
        if contract.mask_kind == "additive_4d" and contract.mask_input is None:
            raise GenerationError("the contract's mask is additive_4d but names no mask input: re-derive it from the graph")
        # the 4D additive mask's input (trees and chains); None: a 2D padding mask or none
        self._bias_input = contract.mask_input if contract.mask_kind == "additive_4d" else None
        # rowwise graphs run every row on one-row kernels, and a length-invariant graph (row guard,
        # export.passes.row_guard) pads inside itself where an op needs it: a lone token is one row
        self.rowwise = contract.kv_layout == "rowwise"
        self.pad_single = not (self.rowwise or contract.length_invariant)   # see forward(); changed only through padding()
        self.last_run_s = 0.0    # seconds inside onnxruntime's run in the last forward
        self.outputs = ["logits"] + (["hidden_states"] if self.has_hidden else []) + self.kv_out
        self.static = in_place(contract.kv_layout)     # buffers bound as past and present
        self.capacity = contract.kv_capacity if self.static else 0
        # released in-place buffers (StaticKV's buffer or GrowingKV's memory) with their IOBinding,
        # reused by the next generation
        self._free: list[tuple[np.ndarray, Any]] = []
        self._out_buf = np.zeros(0, dtype=np.float32)
        # rows decoupled from attention slots (export.inplace): pad slots cost attention only
        self.sparse = SLOT_ROWS in {i.name for i in session.get_inputs()}
        self._arange = np.zeros(0, dtype=np.int64)
        self._feeds: dict[int, RowFeeds] = {}     # rowwise: bound inputs/outputs per row count
        self._feeds_size = 0

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

    def forward(self, tokens: Sequence[int], parents: list[int] | None, kv: Cache,
                embeds: np.ndarray | None = None, copy: bool = True,
                slots: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray | None, list[np.ndarray] | None]:
        """Run new ``tokens`` (a chain when ``parents`` is None) over the cached past.

        ``slots``: a tree in an aligned slot layout (Job.plan): ``parents`` then covers the slots
        (pads: -1) and ``slots[i]`` is token i's slot; outputs come back per token. A graph with
        rows decoupled from slots (export.inplace) runs the tokens only; others run every slot.

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
            logits, hidden, present = self.forward(slot_tokens(list(tokens), slots, len(parents)), parents, kv,
                                                   embeds, copy=copy)
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
        if self.c.primary_input == "inputs_embeds":
            feeds["inputs_embeds"] = embeds if embeds is not None else self.embeddings(toks[None])
        else:
            feeds["input_ids"] = toks[None]
        m = len(parents) if slots is not None and parents is not None else len(toks)   # attention slots (graph rows if dense)
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
            present = [a[:, :, :past + 1] for a in present]
        return logits, hidden, present

    def _forward_rowwise(self, tokens: Sequence[int], parents: list[int] | None, kv: GrowingKV,
                         embeds: np.ndarray | None, copy: bool, slots: Sequence[int] | None,
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
        if f.embeds is not None:     # an inputs_embeds decoder
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
        logits = self._out_buf[:rows * V].reshape(1, rows, V)
        return logits, (self._out_buf[rows * V:need].reshape(1, rows, H) if self.has_hidden else None)

    def embeddings(self, ids: np.ndarray) -> np.ndarray:
        """ids [1, N] -> inputs_embeds [1, N, H] through the embedder the decoder was opened with."""
        if self.embed is None:
            raise GenerationError("this decoder takes inputs_embeds and was opened without an embedder: pass embeds")
        return self.embed(ids)

    def _identity(self, m: int) -> np.ndarray:
        if len(self._arange) < m:
            self._arange = np.arange(max(m, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:m]

    def _run_static(self, feeds: dict[str, np.ndarray], kv: StaticKV, n: int, m: int, rows: int,
                    copy: bool) -> tuple[np.ndarray, np.ndarray | None, None]:
        """One forward on the in-place cache: inputs bound for the new rows only, logits and hidden
        states written straight into one reusable array, K/V rows written into the cache buffer.
        With ``copy=False`` the returned rows are views, valid until the next forward (the engine's
        hot path reads them before that; callers that keep outputs get copies)."""
        import onnxruntime as ort

        _check_room(kv, m)
        b = kv.binding
        for name, arr in feeds.items():
            b.bind_cpu_input(name, arr)
        logits, hidden = self._outputs(rows if self.sparse else m)   # sparse graphs: one row per token
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
        raise GenerationError(f"the KV cache holds {kv.capacity} positions and this step needs {kv.length + rows}: "
                              f"use a shorter prompt or fewer new tokens, or rebuild with a larger --max-context")


class RowFeeds:
    """A rowwise step's inputs and outputs for ``n`` rows over a ``size``-position buffer, as numpy
    arrays bound once as OrtValues sharing their memory: a step writes ids, positions, the write
    index and the mask rows in place, and the run writes logits and hidden states into them.

    Why by hand: binding fresh arrays costs ~10 µs per tensor from Python and a fresh mask
    O(size) allocations, ~0.2 ms per decode step in all; onnxruntime's IOBinding keeps a bound
    OrtValue across runs, so reusing the same memory makes the step's host work a few writes.
    """

    KEEP_ROWS = 64       # row counts up to this keep their feeds between steps (drafts; not prefill chunks)

    def __init__(self, c: Contract, n: int, size: int, outputs: tuple[np.ndarray, np.ndarray | None]):
        self.c, self.n, self.size = c, n, size
        self.ids = np.zeros((1, n), np.int64)
        self.embeds = np.zeros((1, n, c.hidden_size), np.float32) if c.primary_input == "inputs_embeds" else None
        self.pos = np.zeros((1, n), np.int64)
        self.write = np.zeros(1, np.int64)
        self.bias = np.empty((1, 1, n, size), np.float32)
        self.logits, self.hidden = outputs      # views of the decoder's reused output array
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
            np.copyto(self.bias[0, 0], self._windows[start:start + self.n][::-1])
        else:
            pos, bias = row_bias(parents, past, self.size)
            self.pos[:], self.bias[:] = pos, bias

    def bind(self, binding) -> None:
        import onnxruntime as ort

        c = self.c
        primary = ("inputs_embeds", self.embeds) if self.embeds is not None else ("input_ids", self.ids)
        for name, arr in (primary, (c.position_input, self.pos), (c.mask_input, self.bias),
                          (KV_WRITE_INDEX, self.write)):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        binding.bind_ortvalue_output(LOGITS, ort.OrtValue.ortvalue_from_numpy(self.logits))
        if self.hidden is not None:
            binding.bind_ortvalue_output(c.hidden_output, ort.OrtValue.ortvalue_from_numpy(self.hidden))


def _topk_rows(logits: np.ndarray, k: int) -> np.ndarray:
    idx = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    order = np.take_along_axis(logits, idx, axis=-1).argsort(axis=-1)[:, ::-1]
    return np.take_along_axis(idx, order, axis=-1)


PREFILL_CHUNK = 512   # prompt rows per prefill forward (the logits of 512 rows of a 49k vocabulary: 100 MB)


def tree_layout(draft: Draft, step_tokens: list[int], parents: list[int], *, period: int, tile: int | None,
                width: int, capacity: int, past: int) -> tuple[Draft, list[int], list[int], list[int], list[int]]:
    """Place a draft tree (root included in ``step_tokens``/``parents``) in the period-aligned slot
    layout of tree.aligned_layout, within ``period * width`` slots and the cache's room; nodes the
    layout prunes are dropped. Returns (draft, step_tokens, parents, slot per node, slot parents)."""
    max_slots = period * max(1, width) if period else len(step_tokens)
    if capacity:
        max_slots = min(max_slots, capacity - past)
    slot, slot_parents = aligned_layout(parents, period, max_slots, past=past, tile=tile)
    keep = [i for i, s_ in enumerate(slot) if s_ >= 0]
    if len(keep) < len(step_tokens):
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1 if parents[i] < 0 else new_index[parents[i]] for i in keep]
        step_tokens = [step_tokens[i] for i in keep]
        slot = [slot[i] for i in keep]
        draft = Draft([step_tokens[i] for i in range(1, len(keep))], [p - 1 for p in parents[1:]],
                      [draft.probs[i - 1] for i in keep[1:]] if draft.probs is not None else None)
    return draft, step_tokens, parents, slot, slot_parents


class Successors(dict):
    """token id -> the token the verifier last ranked first after it: one guess per token.

    Why: a step whose drafter proposes nothing still runs two rows on a static or concat graph
    (Decoder.forward pads a single token so that its arithmetic matches a batched verify), and
    the pad row costs as much as a real one. Putting this guess there instead verifies one more
    token for free; a wrong guess is rejected like any draft, so output is unchanged. A rowwise
    graph has no pad row: there the guess costs a second row, and Job fills only while it pays
    (FillPolicy). Every verified row teaches it (its input token -> its argmax), after the
    prompt's own bigrams seeded it. One table per request: what other requests
    taught belongs to the drafters' cross-request memory, namespaced where
    tenants must be kept apart."""

    def seed(self, prompt: Sequence[int]) -> None:
        self.update(zip(prompt[:-1], prompt[1:]))

    def learn(self, tokens: Sequence[int], argmax: np.ndarray) -> None:
        self.update(zip(tokens, argmax.tolist()))


class FillPolicy:
    """When an empty step takes the Successors guess, where it costs a row of its own (rowwise).

    Fill iff the guess's acceptance ``p`` beats the second row's relative cost:
    ``(1 + p) / t2 > 1 / t1``, i.e. ``p > t2/t1 - 1``, with ``t1``, ``t2`` this request's
    forward times of one- and two-row steps (forgetful means; ``COST_PRIOR`` until both are seen)
    and ``p`` the request's fill acceptance under a uniform prior (starts at 1/2). A guess that
    stops paying is still tried every ``explore``-th empty step so that ``p`` stays current.
    Measured on SmolLM2 int4-rowwise (18 Spec-Bench prompts, 2 threads): a second row costs
    1.13-1.23x a one-row forward, guesses are accepted 52% of the time, and filling every empty
    step decoded 1.22x plain decoding's tok/s.
    """

    COST_PRIOR = 1.25

    def __init__(self, explore: int = 8, forget: float = 0.9):
        self.explore, self.forget = explore, forget
        self.t = {1: 0.0, 2: 0.0}
        self._skipped = 0

    def observe(self, rows: int, forward_s: float) -> None:
        if rows in self.t and forward_s > 0:
            t = self.t[rows]
            self.t[rows] = forward_s if t == 0.0 else self.forget * t + (1 - self.forget) * forward_s

    def pays(self, filled: int, accepted: int) -> bool:
        p = (accepted + 1) / (filled + 2)
        ratio = self.t[2] / self.t[1] if self.t[1] and self.t[2] else self.COST_PRIOR
        if p > ratio - 1:
            return True
        self._skipped += 1
        return self._skipped % self.explore == 0


class Engine:
    def __init__(self, decoder: Decoder, *, tree_capable: bool, period: int | None = None, tile: int | None = None,
                 fill: Successors | None = None):
        """``period`` and ``tile`` come from runtime.calibration: the layout that keeps tree rows
        bit-identical to chains on this machine. ``fill``: where an empty draft takes its one
        guess from (see Successors); None keeps empty steps plain (the exactness reference)."""
        self.dec = decoder
        self.tree_capable = tree_capable and period is not None
        self.period = period
        self.tile = tile
        self.fill = fill

    def generate(self, prompt_ids: Sequence[int], *, drafter: Drafter, sampler: Sampler,
                 max_new_tokens: int, tree: bool = False, budget: DraftBudget | None = None,
                 eos_ids: Sequence[int] = (), should_stop: Callable[[list[int]], int | None] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, prefill_embeds: np.ndarray | None = None,
                 residual_fn: ResidualFn = residual,
                 validate_drafts: bool = False) -> tuple[list[int], GenerationStats, str]:
        """Generate up to ``max_new_tokens``; returns (new token ids, stats, stop reason).
        Drafts are validated on every step; ``validate_drafts`` is kept for callers that pass it."""
        budget = budget or DraftBudget()
        if budget.tree and not (tree and self.tree_capable):
            budget = DraftBudget(budget.max_nodes, budget.max_depth, 1, False)
        tokens = [int(t) for t in prompt_ids]
        cap = self.dec.capacity
        if cap and len(tokens) + max_new_tokens + 1 > cap:   # +1: the pad row of a one-token step
            raise GenerationError(f"prompt ({len(tokens)} tokens) + max_new_tokens ({max_new_tokens}) does not fit "
                                  f"this decoder's KV cache of {cap} positions: shorten the prompt, lower "
                                  f"max_new_tokens or rebuild with a larger --max-context")
        job = Job(tokens, drafter=drafter, sampler=sampler, max_new_tokens=max_new_tokens, budget=budget,
                  period=self.period if budget.tree else None, tile=self.tile if budget.tree else None,
                  eos_ids=eos_ids, should_stop=should_stop, on_tokens=on_tokens, prefill_embeds=prefill_embeds,
                  capacity=cap, fill=self.fill, residual_fn=residual_fn, single_rows=self.dec.single_rows)
        kv = self.dec.new_cache()
        try:
            while job.prefilling:    # chunks bound the logits buffer of a long prompt
                rows = job.prefill_rows()
                if isinstance(kv, GrowingKV) and kv.length + len(rows.tokens) >= len(tokens):
                    # the last chunk (rowwise): decode room too (earlier chunks must not attend to it, masked)
                    kv.reserve(len(tokens), max_new_tokens + 1 + budget.max_nodes)
                logits, hidden, present = self.dec.forward(
                    rows.tokens, None, kv, embeds=None if rows.embeds is None else rows.embeds[None], copy=False)
                job.after_prefill(partial(kv.commit, present), logits, hidden)
            while not job.done:
                rows = job.plan(kv.length)
                t0 = time.perf_counter()
                logits, hidden, present = self.dec.forward(rows.tokens, rows.parents, kv, copy=False, slots=rows.slots)
                job.after_step(partial(kv.commit, present), logits, hidden,
                               time.perf_counter() - t0, self.dec.last_run_s)
        finally:
            kv.release()
        assert job.reason is not None    # the loop ends when the job has its reason to stop
        return job.new, job.stats, job.reason

    @staticmethod
    def _accept(step_tokens: Sequence[int], parents: Sequence[int], draft: Draft, logits: np.ndarray,
                sampler: Sampler, pos: int, residual_fn: ResidualFn,
                argmax: np.ndarray | None = None) -> tuple[list[int], list[int]]:
        """Walk the tree from the root, committing the target's token at each position
        (``argmax``: every row's, precomputed for greedy decoding)."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents[1:], start=1):
            children.setdefault(p, []).append(i)
        node, path, committed = 0, [0], []
        probs = draft.probs if not sampler.greedy else None    # min(1, p/q) where the drafter gave q
        if argmax is None and sampler.greedy:
            argmax = logits.argmax(-1)
        while True:
            kids = children.get(node, [])
            nxt: int | None
            if probs is not None and len(kids) == 1:
                c = kids[0]
                ok, tok = accept_ratio(sampler.probs(logits[node]), probs[c - 1], step_tokens[c], sampler, pos,
                                       residual_fn)
                nxt = c if ok else None
            else:
                tok = int(argmax[node]) if argmax is not None else sampler.pick(logits[node], pos)
                nxt = next((k for k in kids if step_tokens[k] == tok), None)
            committed.append(tok)
            if nxt is None:
                return committed, path
            node = nxt
            path.append(nxt)
            pos += 1

    @staticmethod
    def _truncate(new: list[int], committed: list[int], eos: set[int] | Sequence[int], max_new: int,
                  should_stop: StopFn | None) -> tuple[list[int], str | None]:
        """Cut this step's tokens at EOS, the token budget or a stop string; say why we stop."""
        reason = None
        committed = committed[:max(0, max_new - len(new))]
        for i, t in enumerate(committed):
            if t in eos:
                committed, reason = committed[:i + 1], "eos"
                break
        if should_stop is not None:
            cut = should_stop(new + committed)
            if cut is not None:
                committed, reason = (new + committed)[len(new):max(cut, len(new))], "stop_string"
        if reason is None and len(new) + len(committed) >= max_new:
            reason = "max_new_tokens"
        return committed, reason


@dataclass
class Rows:
    """What one request feeds a forward: graph rows (tokens, parents per row or None for a chain)
    and, for inputs_embeds decoders, the rows' embeddings."""

    tokens: list[int]
    parents: list[int] | None
    embeds: np.ndarray | None = None     # [rows, hidden]
    slots: list[int] | None = None       # a tree's aligned layout: token i's slot; parents then per slot


class Job:
    """One request's decoding as a step machine: prefill chunks, then per step ``plan`` (draft,
    validate, lay out the rows) -> the caller's forward -> ``after_step`` (accept, commit KV, feed
    back). Engine.generate drives one with its own decoder; the server's scheduler drives many
    and puts all their rows into one batched forward, so both decode a request identically.
    ``commit(n_rows, keep)`` keeps the rows ``keep`` of the ``n_rows`` just fed in the caller's KV."""

    def __init__(self, ids: Sequence[int], *, drafter: Drafter, sampler: Sampler, max_new_tokens: int,
                 budget: DraftBudget, period: int | None, tile: int | None, eos_ids: Sequence[int] = (),
                 should_stop: StopFn | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, prefill_embeds: np.ndarray | None = None,
                 capacity: int = 0, fill: Successors | None = None, residual_fn: ResidualFn = residual,
                 single_rows: int = 2):
        self.tokens = [int(t) for t in ids]
        self.prompt_len = len(self.tokens)
        self.drafter, self.sampler, self.max_new = drafter, sampler, max_new_tokens
        self.budget, self.period, self.tile = budget, period, tile
        self.eos = set(int(e) for e in eos_ids)
        self.should_stop, self.on_tokens = should_stop, on_tokens
        self.prefill_embeds = prefill_embeds
        self.capacity = capacity
        self.fill, self.residual_fn = fill, residual_fn
        self.single_rows = single_rows          # graph rows a lone token costs (its pad row, if any)
        self.fill_policy = FillPolicy() if fill is not None and single_rows < 2 else None   # None: the fill is free
        self.new: list[int] = []
        self.reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(self.tokens))
        self.t_start = time.perf_counter()
        self.prefilled = 0
        # what plan laid out for after_step: (draft, the drafter's own nodes, step tokens, parents,
        # slot per token, slots fed)
        self._step: tuple[Draft, int, list[int], list[int], list[int], int] | None = None
        self._draft_dt = 0.0
        drafter.begin(self.tokens)
        if fill is not None:
            fill.seed(self.tokens)

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_len

    # ------------------------------------------------------------------ prefill
    def prefill_rows(self) -> Rows:
        """The next prompt chunk (PREFILL_CHUNK rows: the same boundaries however it is driven)."""
        i = self.prefilled
        part = self.tokens[i:i + PREFILL_CHUNK]
        emb = None if self.prefill_embeds is None else self.prefill_embeds[0, i:i + PREFILL_CHUNK]
        return Rows(part, None, emb)

    def after_prefill(self, commit: Callable[[int, list[int]], None], logits: np.ndarray,
                      hidden: np.ndarray | None) -> None:
        n = len(self.prefill_rows().tokens)
        commit(n, list(range(n)))
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

    # ------------------------------------------------------------------ decode steps
    def plan(self, kv_length: int) -> Rows:
        """Draft, validate and lay out this step's rows (a tree in its period-aligned slots)."""
        remaining = self.max_new - len(self.new)
        bud = self.budget
        b = DraftBudget(min(bud.max_nodes, 8 * remaining), min(bud.max_depth, remaining - 1), bud.width, bud.tree)
        t1 = time.perf_counter()
        draft = self.drafter.propose(self.tokens, b) if b.max_depth > 0 else Draft()
        self._draft_dt = time.perf_counter() - t1
        self.stats.draft_s += self._draft_dt
        try:   # always (microseconds): a malformed draft would verify wrong positions, not fail
            draft.validate()                     # topology first: parents before children
            draft = draft.within(b)
            draft.validate(b)
        except (ValueError, TypeError, AttributeError) as e:
            raise GenerationError(f"drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)!r} proposed "
                                  f"an invalid draft: {e}") from None
        own = len(draft)                         # the drafter's nodes (a fill is the engine's)
        if not own and self.fill is not None and b.max_depth > 0 and self.tokens[-1] in self.fill and (
                self.fill_policy is None or self.fill_policy.pays(self.stats.filled, self.stats.fill_accepted)):
            draft = Draft([self.fill[self.tokens[-1]]], [-1])
            self.stats.filled += 1
        step_tokens = [self.tokens[-1]] + draft.tokens
        parents = with_root(draft.parents)
        if draft.is_chain():
            self._step = (draft, own, step_tokens, parents, list(range(len(step_tokens))), len(step_tokens))
            return Rows(step_tokens, None)
        if self.period is None:
            raise GenerationError("a tree draft needs the calibrated slot period (Engine period=...): verify chains")
        draft, step_tokens, parents, slot, slot_parents = tree_layout(
            draft, step_tokens, parents, period=self.period, tile=self.tile, width=b.width,
            capacity=self.capacity, past=kv_length)
        self._step = (draft, len(draft), step_tokens, parents, slot, len(slot_parents))
        return Rows(step_tokens, slot_parents, slots=slot)

    def after_step(self, commit: Callable[[int, list[int]], None], logits: np.ndarray, hidden: np.ndarray | None,
                   verify_s: float, forward_s: float) -> None:
        """Accept the longest agreeing path of the rows ``plan`` laid out, given their outputs
        (one row per token: a tree's slots are the forward's business)."""
        if self._step is None:
            raise GenerationError("Job.after_step without a Job.plan before it")
        draft, own, step_tokens, parents, slots, n_slots = self._step
        t3 = time.perf_counter()
        st, sampler = self.stats, self.sampler
        st.verify_s += verify_s
        st.forward_s += forward_s
        if self.fill_policy is not None:
            self.fill_policy.observe(n_slots, forward_s)
        argmax = logits.argmax(-1) if sampler.greedy or self.fill is not None else None   # one pass, all rows
        committed, path = Engine._accept(step_tokens, parents, draft, logits, sampler, len(self.tokens),
                                         self.residual_fn, argmax if sampler.greedy else None)
        if self.fill is not None and argmax is not None:     # (computed above whenever there is a fill)
            self.fill.learn(step_tokens, argmax)
            st.fill_accepted += int(own == 0 and len(path) > 1)
        commit(n_slots, [slots[i] for i in path])
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
        # about the drafter's own nodes, never a fill: a fill's own row (rowwise) is the engine's
        # cost, so that step reports a lone token's rows and no verify time to fit
        paid_fill = self.fill_policy is not None and not own and len(draft) > 0
        d.feedback(Feedback(
            committed=committed, drafted=own, accepted=len(path) - 1 if own else 0,
            accepted_path=[i - 1 for i in path[1:]] if own else [],
            topk_ids=_topk_rows(logits if own else logits[:1], 8) if d.wants_topk else None,
            hidden=hidden[path] if d.wants_hidden and hidden is not None else None,
            draft_seconds=self._draft_dt, verify_seconds=0.0 if paid_fill else verify_s,
            rows=self.single_rows if paid_fill else max(n_slots, self.single_rows)))
        self._step = None
        if self.reason:
            self._finish()

    def _finish(self) -> None:
        self.drafter.end()
        st = self.stats
        st.tokens = len(self.new)
        st.total_s = time.perf_counter() - self.t_start
        st.overhead_s = max(0.0, st.total_s - st.prefill_s - st.draft_s - st.verify_s)
