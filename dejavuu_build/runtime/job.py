"""One request's decoding as a step machine (``Job``): prefill chunks, then per step plan (draft,
validate, lay out rows) -> the caller's forward -> after_step (accept, commit KV, feed back).

Why apart from the loop: Engine.generate drives one Job with its own decoder, and the server's
scheduler drives many and puts all their rows into one batched forward; both share this code, so
a served request decodes exactly as the same ``generate`` call.

Lossless by construction: at every position the committed token is the target's own choice
(argmax, or a draw seeded by the absolute position); drafts only decide how many of those
choices one forward pass can confirm. Drafters with real probabilities use min(1, p/q).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from ..layouts import Rows
from .drafters.base import Draft, DraftBudget, Drafter, Feedback
from .sampling import Sampler, accept_ratio, residual
from .tree import aligned_layout, with_root

ResidualFn = Callable[[np.ndarray, np.ndarray], np.ndarray]  # sampling.residual's signature
StopFn = Callable[[list[int]], "int | None"]  # generated ids -> the prefix length that ends at a stop string


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
    forward_s: float = 0.0  # decode steps' time inside onnxruntime's run (prefill excluded)
    kv_s: float = 0.0
    overhead_s: float = 0.0
    total_s: float = 0.0
    accept_hist: list[int] = field(default_factory=list)  # accepted draft tokens per step
    filled: int = 0  # steps whose empty draft took the pad row's place (Engine ``fill``)
    fill_accepted: int = 0  # ... and whose filled token was accepted

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
        d.update(
            mean_accepted=round(self.mean_accepted, 3),
            tokens_per_step=round(self.tokens_per_step, 3),
            acceptance_rate=round(self.acceptance_rate, 3),
            decode_tok_s=round(self.decode_tok_s, 2),
            host_ms_per_step=round(self.host_ms_per_step, 4),
        )
        for k, v in list(d.items()):
            if isinstance(v, float):
                d[k] = round(v, 5)
        return d


def _topk_rows(logits: np.ndarray, k: int) -> np.ndarray:
    idx = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    order = np.take_along_axis(logits, idx, axis=-1).argsort(axis=-1)[:, ::-1]
    return np.take_along_axis(idx, order, axis=-1)


# KV room a request needs past its prompt and new tokens: a lone token's step runs two attention rows
# (the static graph's floor, a pad row), the last token's second one past the context. Nothing else:
# a chain is cut to the tokens left (Job.plan) and a tree to the cache's room (tree_layout), so every
# path (generate, the API, the server) accepts the same requests.
STEP_ROOM = S.GQA_MIN_ROWS - 1


def tree_layout(
    draft: Draft,
    step_tokens: list[int],
    parents: list[int],
    *,
    period: int,
    tile: int | None,
    width: int,
    capacity: int,
    past: int,
) -> tuple[Draft, list[int], list[int], list[int], list[int]]:
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
        draft = Draft(
            [step_tokens[i] for i in range(1, len(keep))],
            [p - 1 for p in parents[1:]],
            [draft.probs[i - 1] for i in keep[1:]] if draft.probs is not None else None,
        )
    return draft, step_tokens, parents, slot, slot_parents


class Successors:
    """The guess for the token after the context: what the verifier last ranked first after the
    context's last two tokens, else after its last one.

    Why: a step whose drafter proposes nothing still runs two rows on a static or concat graph
    (Decoder.forward pads a single token so that its arithmetic matches a batched verify), and
    the pad row costs as much as a real one. Putting this guess there instead verifies one more
    token for free; a wrong guess is rejected like any draft, so output is unchanged. A rowwise
    graph has no pad row: there the guess costs a second row, and Job fills only while it pays
    (FillPolicy). Every verified row teaches it (its input token, and the token before it, ->
    its argmax), after the prompt's own bigrams and trigrams seeded it. Why the pair first: on
    the 60 Spec-Bench answers of docs/speed.md (eighteenth session), the last-seen successor of
    the token pair, where one was seen, else of the token, is the next token at 40.9% of
    positions against 33.4% for the token's alone (qa 22.3 / 20.7%, math 46.7 / 37.2%). One table
    per request: what other requests taught belongs to the drafters' cross-request memory,
    namespaced where tenants must be kept apart."""

    def __init__(self) -> None:
        self.one: dict[int, int] = {}  # token -> the token after it
        self.two: dict[tuple[int, int], int] = {}  # (token before, token) -> the token after them

    def seed(self, prompt: Sequence[int]) -> None:
        p = [int(t) for t in prompt]
        self.one.update(zip(p[:-1], p[1:]))
        self.two.update(zip(zip(p[:-2], p[1:-1]), p[2:]))

    def learn(self, tokens: Sequence[int], argmax: Sequence[int] | np.ndarray, before: Sequence[int | None]) -> None:
        """Rows ``tokens`` verified with outputs ``argmax``; ``before[i]``: the token before row
        ``i`` in its own path (None where there is none)."""
        nxt = argmax.tolist() if isinstance(argmax, np.ndarray) else list(argmax)
        for t, b, a in zip(tokens, before, nxt):
            self.one[int(t)] = int(a)
            if b is not None:
                self.two[(int(b), int(t))] = int(a)

    def guess(self, context: Sequence[int]) -> int | None:
        """The guess after ``context`` (None: its last token was never seen with a successor)."""
        if not context:
            return None
        if len(context) > 1 and (g := self.two.get((int(context[-2]), int(context[-1])))) is not None:
            return g
        return self.one.get(int(context[-1]))


class FillPolicy:
    """When an empty step takes the Successors guess, where it costs a row of its own (rowwise).

    Fill iff the guess's acceptance ``p`` beats the second row's relative cost:
    ``(1 + p) / t2 > 1 / t1``, i.e. ``p > t2/t1 - 1``, with ``t1``, ``t2`` this request's
    forward times of one- and two-row steps (forgetful means; ``COST_PRIOR`` until both are seen)
    and ``p`` the request's fill acceptance under a uniform prior (starts at 1/2). A guess that
    stops paying is still tried every ``explore``-th empty step so that ``p`` stays current.
    Why a rule rather than always filling: the second row's cost and the guess's acceptance vary
    by machine and text (measured: docs/runtime.md).
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


def accept_path(
    step_tokens: Sequence[int],
    parents: Sequence[int],
    draft: Draft,
    logits: np.ndarray,
    sampler: Sampler,
    pos: int,
    residual_fn: ResidualFn,
    argmax: np.ndarray | None = None,
) -> tuple[list[int], list[int]]:
    """Walk the tree from the root, committing the target's token at each position (``argmax``:
    every row's, precomputed for greedy decoding); returns (committed tokens, the path of step
    nodes accepted, root first). Lossless: every committed token is the target's own choice."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        children.setdefault(p, []).append(i)
    node, path, committed = 0, [0], []
    probs = draft.probs if not sampler.greedy else None  # min(1, p/q) where the drafter gave q
    if argmax is None and sampler.greedy:
        argmax = logits.argmax(-1)
    while True:
        kids = children.get(node, [])
        nxt: int | None
        if probs is not None and len(kids) == 1:
            c = kids[0]
            ok, tok = accept_ratio(sampler.probs(logits[node]), probs[c - 1], step_tokens[c], sampler, pos, residual_fn)
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


def cut_step(
    new: list[int], committed: list[int], eos: set[int] | Sequence[int], max_new: int, should_stop: StopFn | None
) -> tuple[list[int], str | None]:
    """This step's ``committed`` tokens cut at EOS, the token budget or a stop string (``new``: those
    generated before the step), with why the generation stops (None: it goes on)."""
    reason = None
    committed = committed[: max(0, max_new - len(new))]
    for i, t in enumerate(committed):
        if t in eos:
            committed, reason = committed[: i + 1], "eos"
            break
    if should_stop is not None:
        cut = should_stop(new + committed)
        if cut is not None:
            committed, reason = (new + committed)[len(new) : max(cut, len(new))], "stop_string"
    if reason is None and len(new) + len(committed) >= max_new:
        reason = "max_new_tokens"
    return committed, reason


class StepTokens(list):
    """The ids one step commits, as ``on_tokens`` receives them: a plain list of ids to every caller,
    with how they were produced, for callers that show it (the server's stream). The first
    ``accepted`` ids are draft tokens the verify accepted, the rest the model's own picks;
    ``drafted``: the draft's size that step (a fill's guess included); ``step`` False for the token
    prefill picks (no verify step)."""

    def __init__(self, ids: Sequence[int], drafted: int = 0, accepted: int = 0, step: bool = True):
        super().__init__(ids)
        self.drafted, self.accepted, self.step = drafted, min(accepted, len(self)), step


class Job:
    """One request's decoding as a step machine: prefill chunks, then per step ``plan`` (draft,
    validate, lay out the rows) -> the caller's forward -> ``after_step`` (accept, commit KV, feed
    back). Engine.generate drives one with its own decoder; the server's scheduler drives many
    and puts all their rows into one batched forward, so both decode a request identically.
    ``commit(n_rows, keep)`` keeps the rows ``keep`` of the ``n_rows`` just fed in the caller's KV."""

    def __init__(
        self,
        ids: Sequence[int],
        *,
        drafter: Drafter,
        sampler: Sampler,
        max_new_tokens: int,
        budget: DraftBudget,
        period: int | None,
        tile: int | None,
        eos_ids: Sequence[int] = (),
        should_stop: StopFn | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        prefill_embeds: np.ndarray | None = None,
        capacity: int = 0,
        fill: Successors | None = None,
        residual_fn: ResidualFn = residual,
        single_rows: int = 2,
    ):
        self.tokens = [int(t) for t in ids]
        self.prompt_len = len(self.tokens)
        self.drafter, self.sampler, self.max_new = drafter, sampler, max_new_tokens
        self.budget, self.period, self.tile = budget, period, tile
        self.eos = set(int(e) for e in eos_ids)
        self.should_stop, self.on_tokens = should_stop, on_tokens
        self.prefill_embeds = prefill_embeds
        self.capacity = capacity
        self.fill, self.residual_fn = fill, residual_fn
        self.single_rows = single_rows  # graph rows a lone token costs (its pad row, if any)
        self.fill_policy = FillPolicy() if fill is not None and single_rows < 2 else None  # None: the fill is free
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
    def room(self) -> int:
        """Positions the decoding may write past the prompt: every new token and a step's drafts
        (what a rowwise buffer reserves before the prompt's last chunk: Decoder.prefill)."""
        return self.max_new + 1 + self.budget.max_nodes

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prompt_len

    # ------------------------------------------------------------------ prefill
    def prefill_rows(self) -> Rows:
        """The next prompt chunk (S.PREFILL_CHUNK rows: the same boundaries however it is driven)."""
        i = self.prefilled
        part = self.tokens[i : i + S.PREFILL_CHUNK]
        emb = None if self.prefill_embeds is None else self.prefill_embeds[0, i : i + S.PREFILL_CHUNK]
        return Rows(part, None, emb)

    def after_prefill(
        self, commit: Callable[[int, list[int]], None], logits: np.ndarray, hidden: np.ndarray | None
    ) -> None:
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
        d.feedback(
            Feedback(
                committed=[first],
                drafted=0,
                accepted=0,
                topk_ids=_topk_rows(logits[-1:], 8) if d.wants_topk else None,
                hidden=hidden[-1:].copy() if d.wants_hidden and hidden is not None else None,
            )
        )
        if self.on_tokens:
            self.on_tokens(StepTokens([first], step=False))
        _, self.reason = cut_step([], [first], self.eos, self.max_new, self.should_stop)
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
        try:  # always (microseconds): a malformed draft would verify wrong positions, not fail
            draft.validate()  # topology first: parents before children
            draft = draft.within(b)
            draft.validate(b)
        except (ValueError, TypeError, AttributeError) as e:
            raise GenerationError(
                f"drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)!r} proposed an invalid draft: {e}"
            ) from None
        own = len(draft)  # the drafter's nodes (a fill is the engine's)
        guess = self.fill.guess(self.tokens) if not own and self.fill is not None and b.max_depth > 0 else None
        if guess is not None and (
            self.fill_policy is None or self.fill_policy.pays(self.stats.filled, self.stats.fill_accepted)
        ):
            draft = Draft([guess], [-1])
            self.stats.filled += 1
        step_tokens = [self.tokens[-1]] + draft.tokens
        parents = with_root(draft.parents)
        if draft.is_chain():
            self._step = (draft, own, step_tokens, parents, list(range(len(step_tokens))), len(step_tokens))
            return Rows(step_tokens, None)
        if self.period is None:
            raise GenerationError("a tree draft needs the calibrated slot period (Engine period=...): verify chains")
        draft, step_tokens, parents, slot, slot_parents = tree_layout(
            draft,
            step_tokens,
            parents,
            period=self.period,
            tile=self.tile,
            width=b.width,
            capacity=self.capacity,
            past=kv_length,
        )
        self._step = (draft, len(draft), step_tokens, parents, slot, len(slot_parents))
        return Rows(step_tokens, slot_parents, slots=slot)

    def after_step(
        self,
        commit: Callable[[int, list[int]], None],
        logits: np.ndarray,
        hidden: np.ndarray | None,
        verify_s: float,
        forward_s: float,
    ) -> None:
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
        argmax = logits.argmax(-1) if sampler.greedy or self.fill is not None else None  # one pass, all rows
        committed, path = accept_path(
            step_tokens,
            parents,
            draft,
            logits,
            sampler,
            len(self.tokens),
            self.residual_fn,
            argmax if sampler.greedy else None,
        )
        if self.fill is not None and argmax is not None:  # (computed above whenever there is a fill)
            root_before = self.tokens[-2] if len(self.tokens) > 1 else None  # the root is self.tokens[-1]
            before = [root_before] + [step_tokens[q] for q in parents[1:]]
            self.fill.learn(step_tokens, argmax, before)
            st.fill_accepted += int(own == 0 and len(path) > 1)
        commit(n_slots, [slots[i] for i in path])
        st.kv_s += time.perf_counter() - t3
        st.steps += 1
        st.drafted += len(draft)
        st.accepted += len(path) - 1
        st.accept_hist.append(len(path) - 1)
        committed, self.reason = cut_step(self.new, committed, self.eos, self.max_new, self.should_stop)
        self.tokens += committed
        self.new += committed
        if self.on_tokens and committed:
            self.on_tokens(StepTokens(committed, len(draft), len(path) - 1))
        d = self.drafter
        # about the drafter's own nodes, never a fill: a fill's own row (rowwise) is the engine's
        # cost, so that step reports a lone token's rows and no verify time to fit
        paid_fill = self.fill_policy is not None and not own and len(draft) > 0
        d.feedback(
            Feedback(
                committed=committed,
                drafted=own,
                accepted=len(path) - 1 if own else 0,
                accepted_path=[i - 1 for i in path[1:]] if own else [],
                topk_ids=_topk_rows(logits if own else logits[:1], 8) if d.wants_topk else None,
                hidden=hidden[path] if d.wants_hidden and hidden is not None else None,
                draft_seconds=self._draft_dt,
                verify_seconds=0.0 if paid_fill else verify_s,
                rows=self.single_rows if paid_fill else max(n_slots, self.single_rows),
            )
        )
        self._step = None
        if self.reason:
            self._finish()

    def _finish(self) -> None:
        self.drafter.end()
        st = self.stats
        st.tokens = len(self.new)
        st.total_s = time.perf_counter() - self.t_start
        st.overhead_s = max(0.0, st.total_s - st.prefill_s - st.draft_s - st.verify_s)
