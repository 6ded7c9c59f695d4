"""``auto``: choose among several drafters online, per step, by expected tokens per second, and
decode plainly where no draft pays for its rows and its own drafting time."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Sequence

from .base import Draft, DraftBudget, Drafter, Feedback
from .history import REGISTRY, HistoryDrafter, make_drafter, register
from .sizing import RowCosts
from .trees import accepted_length

# suffix_vote alone: every other member added to it lowered the offline replay (docs/methods.md,
# 2026-12-05); pass members= for a portfolio, e.g. ("pld", "suffix_decoding", "token_recycling",
# "lookahead"), the default before, for trees (suffix_vote drafts chains whatever the budget)
DEFAULT_MEMBERS: tuple[str, ...] = ("suffix_vote",)
# members draft as deep as the budget allows: auto cuts each draft where its measured acceptance stops paying
DEFAULT_MEMBER_PARAMS: dict[str, dict] = {"suffix_decoding": {"spec_factor": None, "max_candidates": 8}}
MAX_LEVEL = 16  # acceptance is tracked per draft level up to this depth (deeper levels share the last)


def _bucket(match_len: int) -> int:
    """Match lengths 0, 1, 2, 3, 4-5, 6-8, 9-15, 16+ (0: not a copy, or unknown)."""
    for i, top in enumerate((0, 1, 2, 3, 5, 8, 15)):
        if match_len <= top:
            return i
    return 7


class LevelAcceptance:
    """Forgetful per-level acceptance of one member's drafts: ``alpha[j]`` is the chance that draft
    level ``j`` is accepted given levels ``1 .. j-1`` were (a hazard model, so drafts cut short by
    their depth or by the end of a request count only for the levels they reached)."""

    def __init__(self, forget: float = 0.97):
        self.forget = forget
        self.reach = [0.0] * (MAX_LEVEL + 1)
        self.hit = [0.0] * (MAX_LEVEL + 1)

    def learn(self, depth: int, accepted: int, known: int) -> None:
        """A draft ``depth`` deep whose first ``accepted`` levels were accepted, judged against
        ``known`` true tokens (fewer than the draft's depth only at the end of a request)."""
        f = self.forget
        self.reach = [x * f for x in self.reach]
        self.hit = [x * f for x in self.hit]
        for j in range(1, min(depth, known) + 1):
            if accepted < j - 1:
                break
            k = min(j, MAX_LEVEL)
            self.reach[k] += 1.0
            self.hit[k] += 1.0 if accepted >= j else 0.0

    def alpha(self, j: int, prior: float, weight: float = 2.0) -> float:
        k = min(j, MAX_LEVEL)
        return (self.hit[k] + prior * weight) / (self.reach[k] + weight)


@register("auto")
class Auto(Drafter):
    """A bandit over member drafters that are all kept in sync, with plain decoding as an arm.

    Per step the members expected to help most propose (the two best by their recent yield, and
    every member every ``probe_every``-th proposing step); each draft is valued, for every depth
    ``n`` it can be cut to, at ``(1 + E[accepted | n]) / verify_time(rows(n))``, where the
    acceptance per level is learnt per member and match-length bucket from every draft any member
    made (counterfactually for those not played, scored against the tokens committed after it,
    however many steps later), and ``verify_time`` is learnt from ``Feedback.verify_seconds`` over the
    graph rows each step ran (``Feedback.rows``; ``sizing.RowCosts``). The best (member, depth) is played; depth 0 is a
    plain step (where a lone token is one graph row, a draft must earn its rows). With chance
    ``explore`` (default 0: the counterfactual scoring measures every level of every draft already)
    a random member's whole draft is played instead.

    Drafting itself costs time, which the per-step choice cannot win back once spent. So ``auto``
    also keeps, per request, a forgetful mean of what proposing saved per step against plain
    decoding at the fitted row costs (tokens committed × a one-row step, less the step's verify
    and draft time), judged once it holds ``patience`` proposing steps' worth of evidence (a
    self-sizing member that drafts nothing where nothing pays loses its draft time on each such
    step: judged on a few of them, it would be silenced just before the text turns copyable);
    when it is negative it stops asking the members for drafts and decodes
    plainly for ``backoff`` steps (doubling, up to ``max_backoff``, each time a probe does not
    pay), then proposes again: by construction it spends little more than plain decoding where
    drafting does not pay on this machine, and re-decides as acceptance changes.

    All members see every ``begin``/``feedback``/``end``; non-chosen members get the chosen draft as
    "the draft that was verified" (token recycling needs it to map top-k rows) and
    ``drafted = accepted = 0`` so adaptive sizers do not learn from someone else's draft.
    """

    uses_datastore = True  # handed on to the members that retrieve from one

    def __init__(
        self,
        members: Sequence[str] = DEFAULT_MEMBERS,
        *,
        datastore=None,
        explore: float = 0.0,
        forget: float = 0.9,
        seed: int = 0,
        member_params: dict[str, dict] | None = None,
        probe_every: int = 8,
        queried: int = 2,
        gain_forget: float = 0.95,
        patience: float = 8.0,
        backoff: int = 4,
        max_backoff: int = 64,
        fallback: bool = True,
    ):
        bad = [m for m in members if m in ("auto", "baseline") or m not in REGISTRY]
        if bad or not members:
            raise ValueError(f"auto members must be registered drafters other than auto/baseline, got {list(members)}")
        params = {m: dict(p) for m, p in DEFAULT_MEMBER_PARAMS.items()}
        for m, p in (member_params or {}).items():
            params.setdefault(m, {}).update(p)
        self.member_names = tuple(members)
        self.members = [make_drafter(m, datastore=datastore, **params.get(m, {})) for m in members]
        self.wants_topk = any(m.wants_topk for m in self.members)
        self.wants_hidden = any(m.wants_hidden for m in self.members)
        self.explore, self.forget = explore, forget
        self.probe_every, self.queried = max(1, probe_every), max(1, queried)
        self.gain_forget, self.min_backoff, self.max_backoff = gain_forget, max(1, backoff), max(1, max_backoff)
        self.patience = min(patience, 0.99 / (1.0 - gain_forget)) if gain_forget < 1 else patience
        self.fallback = fallback  # False: never decode plainly without asking the members (the old auto)
        self._rng = random.Random(seed)
        k = len(self.members)
        # per member: match-length bucket -> per-level acceptance; bucket -1 pools all buckets (the prior)
        self._acc: list[dict[int, LevelAcceptance]] = [{-1: LevelAcceptance(forget)} for _ in range(k)]
        self._yield = [1.0] * k  # forgetful mean of accepted tokens a member's draft would give per query
        self._draft_s = [0.0] * k  # forgetful mean of each member's draft time
        self._cost = RowCosts()
        self._drafts: list[Draft] = [Draft()] * k
        self._buckets = [0] * k
        self._pending: list[tuple[int, int, int, Draft]] = []  # (history position, member, bucket, draft)
        self._hist: list[int] = []
        self._proposals = 0
        self.chosen = -1
        self._begin_request()

    # -- request state --------------------------------------------------------------------------

    def _begin_request(self) -> None:
        self._gain = 0.0  # forgetful mean of seconds saved per proposing step (this request)
        self._gain_w = 0.0
        self._plain_left = 0  # plain steps left before the next proposing step (a request starts with a probe)
        if not hasattr(self, "_backoff"):  # how long the next plain stretch is: kept across requests
            self._backoff = self.min_backoff
        self._spent = 0.0  # draft seconds of the step in flight
        self.plain_steps = 0  # steps this request decoded plainly without asking the members
        self._asked = True  # whether the members were asked this step (else their feedback waits)

    @property
    def chosen_name(self) -> str | None:
        return self.member_names[self.chosen] if self.chosen >= 0 else None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._score_pending(final=True)
        self._hist = [int(t) for t in prompt_ids]
        self._begin_request()
        self.chosen = -1
        for m in self.members:
            m.begin(prompt_ids)

    # -- estimates ------------------------------------------------------------------------------

    def expected_accepted(self, i: int, bucket: int, n: int) -> float:
        """Member ``i``'s expected accepted tokens for a chain cut to ``n`` levels from a match in ``bucket``."""
        pooled = self._acc[i][-1]
        own = self._acc[i].get(bucket, pooled)
        e, surv = 0.0, 1.0
        for j in range(1, n + 1):
            surv *= own.alpha(j, pooled.alpha(j, 0.5))
            e += surv
        return e

    def _time(self, nodes: int) -> float:
        return self._cost.seconds(nodes)

    def _best_cut(self, i: int, draft: Draft) -> tuple[float, int]:
        """(tokens per second, depth) of member ``i``'s draft cut at its best depth (0: drafting nothing)."""
        plain = 1.0 / self._time(0)
        best = (plain, 0)
        chain = draft.is_chain()
        pooled = self._acc[i][-1]
        own = self._acc[i].get(self._buckets[i], pooled)
        if getattr(self.members[i], "sizes_itself", False):
            # the member cut its draft by its own measured acceptance and row costs: play it whole
            # (valued by auto's estimate, to choose among members, never below a plain step's)
            e, surv = 0.0, 1.0
            for n in range(1, draft.depth() + 1):
                surv *= own.alpha(n, pooled.alpha(n, 0.5))
                e += surv
            return (max((1.0 + e) / self._time(len(draft)), plain * (1.0 + 1e-9)), draft.depth())
        e, surv = 0.0, 1.0  # expected accepted of the cut at depth n, and the chance of reaching level n
        for n in range(1, draft.depth() + 1):
            surv *= own.alpha(n, pooled.alpha(n, 0.5))
            e += surv
            nodes = n if chain else len(draft.within(DraftBudget(len(draft), n, len(draft), True)))
            rate = (1.0 + e) / self._time(nodes)
            if rate > best[0]:
                best = (rate, n)
        return best

    # -- the step -------------------------------------------------------------------------------

    def _ask(self) -> list[int]:
        """The members asked for a draft this step: every one each ``probe_every``-th proposal, else
        the ``queried`` best by recent yield net of their draft time (in one-row steps)."""
        self._proposals += 1
        k = len(self.members)
        if k <= self.queried or self._proposals % self.probe_every == 1:
            return list(range(k))
        a = self._time(0)
        net = [self._yield[i] - self._draft_s[i] / a for i in range(k)]
        return sorted(range(k), key=lambda i: -net[i])[: self.queried]

    def propose(self, context: Sequence[int], budget: DraftBudget) -> Draft:
        self.chosen = -1
        self._spent = 0.0
        self._drafts = [Draft()] * len(self.members)
        self._sync(context)
        if self._plain_left > 0:
            self._plain_left -= 1
            self.plain_steps += 1
            self.wants_topk = False  # nobody drafts from this step's top-k: the engine skips it
            self._asked = False
            return Draft()
        self._asked = True
        pos = len(self._hist)
        asked = self._ask()
        self.wants_topk = any(self.members[i].wants_topk for i in asked)
        for i, m in enumerate(self.members):
            if i not in asked and isinstance(m, HistoryDrafter):
                m.sync(context)  # constant time when in step (the engine's context grows by feedback)
        for i in asked:
            m = self.members[i]
            t0 = time.perf_counter()
            d = m.propose(context, budget)
            dt = time.perf_counter() - t0
            self._spent += dt
            self._draft_s[i] = dt if self._draft_s[i] == 0 else 0.9 * self._draft_s[i] + 0.1 * dt
            self._drafts[i] = d
            self._buckets[i] = _bucket(getattr(m, "match_len", 0))
            if len(d):
                self._pending.append((pos, i, self._buckets[i], d))
            else:
                self._yield[i] *= 0.9
        live = [i for i, d in enumerate(self._drafts) if len(d)]
        if not live:
            return Draft()
        if self._rng.random() < self.explore:
            self.chosen = self._rng.choice(live)
            return self._drafts[self.chosen]
        rate, n, i = max((*self._best_cut(i, self._drafts[i]), i) for i in live)
        if n == 0:
            return Draft()  # no draft earns its rows: the bonus token only
        self.chosen = i
        d = self._drafts[i]
        if n < d.depth():
            d = d.within(DraftBudget(len(d), n, max(len(d), 1), True))
        self._drafts[i] = d
        return d

    def _sync(self, context: Sequence[int]) -> None:
        h = self._hist
        if len(context) >= len(h) and (not h or int(context[len(h) - 1]) == h[-1]):
            h.extend(int(t) for t in context[len(h) :])
        else:  # the engine rewound or switched request
            self._pending.clear()
            self._hist = [int(t) for t in context]

    def _score_pending(self, final: bool = False) -> None:
        """Learn from every draft whose fate the committed tokens now decide (all of them at the end
        of a request, judged on what was committed)."""
        keep = []
        for pos, i, bucket, d in self._pending:
            truth = self._hist[pos:]
            acc = accepted_length(d, truth)
            depth = d.depth()
            if acc < min(len(truth), depth) or acc >= depth or final:
                for key in (-1, bucket):
                    self._acc[i].setdefault(key, LevelAcceptance(self.forget)).learn(depth, acc, len(truth))
                self._yield[i] = 0.9 * self._yield[i] + 0.1 * acc
            else:
                keep.append((pos, i, bucket, d))
        self._pending = keep

    def feedback(self, fb: Feedback) -> None:
        proposed = self._spent > 0
        self._hist.extend(int(t) for t in fb.committed)
        self._score_pending()
        self._cost.learn(fb)
        if proposed:
            self._learn_gain(fb)
        elif not self._asked:
            # a plain stretch: the members catch up with the context when next asked (in one
            # extend of their indices) or at the end of the request
            self.chosen = -1
            return
        chosen = self._drafts[self.chosen] if self.chosen >= 0 else Draft()
        # the others learn no acceptance from another's draft, but the step's time and rows are the
        # machine's: a self-sizing member (suffix_vote) prices its rows from every step, as alone
        # (fed only its own drafts' steps it never timed a one-row step, fitted one at 4 ms where
        # steps took 9-10, and cut its drafts to one token: Gemma-3 qa 1.64 tokens a step against
        # its 3.16 alone, 2026-12-07)
        rows = fb.rows or fb.drafted + 1  # the step's rows, now that drafted no longer says them
        quiet = replace(fb, drafted=0, accepted=0, accepted_path=[], draft_seconds=0.0, rows=rows)
        for i, m in enumerate(self.members):
            if i == self.chosen:
                m.feedback(fb)
            else:
                if isinstance(m, HistoryDrafter):
                    m.observe_verified(chosen)
                m.feedback(quiet)
        self._drafts = [Draft()] * len(self.members)
        self.chosen = -1

    def _learn_gain(self, fb: Feedback) -> None:
        """What this proposing step saved against plain decoding, at the fitted row costs; after a
        losing stretch, plain steps for a while (each losing probe doubles the wait)."""
        if not self._cost.ready:
            return
        one = self._time(0)
        rows = max((fb.rows or fb.drafted + 1) - 1, 0)
        spent = self._time(rows) if fb.drafted else one
        # the draft's accepted tokens (an engine's fill guess is the engine's, in both modes alike)
        saved = (1 + fb.accepted) * one - spent - self._spent
        w = self._gain_w * self.gain_forget
        self._gain = (self._gain * w + saved) / (w + 1.0)
        self._gain_w = w + 1.0
        if self.fallback and self._gain_w >= self.patience and self._gain < 0.0:
            self._plain_left = self._backoff
            self._backoff = min(2 * self._backoff, self.max_backoff)
            self._gain_w = 0.0  # the next probe is judged on its own steps
            self._gain = 0.0
        elif self._gain > 0.0:
            self._backoff = self.min_backoff

    def end(self) -> None:
        self._score_pending(final=True)
        for m in self.members:
            if isinstance(m, HistoryDrafter):
                m.sync(self._hist)  # what a plain stretch left unindexed (suffix_decoding keeps it)
            m.end()
