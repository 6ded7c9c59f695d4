"""``auto``: choose among several drafters online, per step, by expected tokens per second."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from typing import Sequence

from .base import Draft, DraftBudget, Drafter, Feedback
from .history import REGISTRY, HistoryDrafter, register
from .sizing import VerifyCostModel
from .trees import accepted_length

DEFAULT_MEMBERS = ("pld", "suffix_decoding", "token_recycling", "lookahead")


@register("auto")
class Auto(Drafter):
    """A bandit over member drafters that are all kept in sync.

    Every step each member proposes (each is sub-millisecond); after verification, every
    member's draft is scored against the committed tokens -- the accepted length it *would*
    have had (a lower bound for non-chosen members, censored at the committed length) -- so
    all arms learn every step, not just the one played. The next draft comes from the member
    maximising ``(1 + acceptance) / (draft time + verify_time(rows))``: acceptance is
    estimated per member and draft depth (adaptive members signal confidence by depth),
    ``verify_time`` is fitted to ``Feedback.verify_seconds`` over the graph rows each step ran
    (``Feedback.rows``), draft time is every member's (all of them propose every step), and
    with chance ``explore`` a random non-empty member is played. Where a lone token is one
    graph row (rowwise decoders), drafting nothing is an arm too: a draft must earn its rows,
    as in ``CostAwareSizer``; where it is two (padded decoders), one node is free and some
    member always plays. Estimates decay across requests rather than reset, so a new request
    starts from what worked before.

    All members see every ``begin``/``feedback``/``end``; non-chosen members get the chosen
    draft as "the draft that was verified" (token recycling needs it to map top-k rows) and
    ``drafted = accepted = 0`` so adaptive sizers do not learn from someone else's draft.
    Wins when the workload mixes copy-heavy and free-form requests; costs the sum of the
    members' draft times.
    """

    uses_datastore = True  # handed on to the members that retrieve from one

    def __init__(
        self,
        members: Sequence[str] = DEFAULT_MEMBERS,
        *,
        datastore=None,
        explore: float = 0.05,
        forget: float = 0.9,
        request_forget: float = 0.5,
        seed: int = 0,
        member_params: dict[str, dict] | None = None,
    ):
        from . import make_drafter  # registry is complete once the package is imported

        bad = [m for m in members if m in ("auto", "baseline") or m not in REGISTRY]
        if bad or not members:
            raise ValueError(f"auto members must be registered drafters other than auto/baseline, got {list(members)}")
        member_params = member_params or {}
        self.member_names = tuple(members)
        self.members = [make_drafter(m, datastore=datastore, **member_params.get(m, {})) for m in members]
        self.wants_topk = any(m.wants_topk for m in self.members)
        self.wants_hidden = any(m.wants_hidden for m in self.members)
        self.explore, self.forget, self.request_forget = explore, forget, request_forget
        self._rng = random.Random(seed)
        k = len(self.members)
        # per member: depth -> [forgetful mean of (counterfactual) accepted tokens, weight];
        # depth 0 pools all depths and is the prior for depths seen rarely.
        self._acc: list[dict[int, list[float]]] = [{0: [1.0, 0.0]} for _ in range(k)]
        self._draft_s = [0.0] * k  # forgetful mean of each member's draft time
        self._cost = VerifyCostModel()
        self._drafts: list[Draft] = [Draft()] * k
        self.chosen = -1

    @property
    def chosen_name(self) -> str | None:
        return self.member_names[self.chosen] if self.chosen >= 0 else None

    def begin(self, prompt_ids: Sequence[int]) -> None:
        for stats in self._acc:
            for entry in stats.values():
                entry[1] *= self.request_forget
        self.chosen = -1
        for m in self.members:
            m.begin(prompt_ids)

    def expected_accepted(self, i: int, depth: int) -> float:
        """Member ``i``'s accepted length for a draft this deep, shrunk toward its overall mean."""
        pooled, _ = self._acc[i][0]
        mean, weight = self._acc[i].get(depth, (pooled, 0.0))
        return (mean * weight + pooled * 2.0) / (weight + 2.0)

    def _rate(self, accepted: float, nodes: int) -> float:
        """Expected tokens per second of a step drafting ``nodes`` that accepts ``accepted``."""
        a, b = self._cost.coefficients() if self._cost.ready else (1.0, 0.0)
        return (1.0 + accepted) / (a + b * self._cost.extra_rows(nodes) + sum(self._draft_s))

    def _value(self, i: int) -> float:
        draft = self._drafts[i]
        return self._rate(self.expected_accepted(i, draft.depth()), len(draft))

    def propose(self, context: Sequence[int], budget: DraftBudget) -> Draft:
        for i, m in enumerate(self.members):
            t0 = time.perf_counter()
            self._drafts[i] = m.propose(context, budget)
            dt = time.perf_counter() - t0
            self._draft_s[i] = dt if self._draft_s[i] == 0 else 0.9 * self._draft_s[i] + 0.1 * dt
        live = [i for i, d in enumerate(self._drafts) if len(d)]
        if not live:
            self.chosen = -1
            return Draft()
        if self._rng.random() < self.explore:
            self.chosen = self._rng.choice(live)
        else:
            self.chosen = max(live, key=self._value)
            if self._cost.single_rows == 1 and self._cost.ready and self._rate(0.0, 0) > self._value(self.chosen):
                self.chosen = -1  # no draft earns its rows: one graph row, the bonus token only
                return Draft()
        return self._drafts[self.chosen]

    def feedback(self, fb: Feedback) -> None:
        if self.chosen >= 0:
            truth = fb.committed
            for i, d in enumerate(self._drafts):
                if not len(d):
                    continue  # estimates are conditional on the member having a draft
                score = fb.accepted if i == self.chosen else accepted_length(d, truth)
                for key in (0, d.depth()):
                    entry = self._acc[i].setdefault(key, [0.0, 0.0])
                    w = entry[1] * self.forget
                    entry[0] = (entry[0] * w + score) / (w + 1)
                    entry[1] = w + 1
        self._cost.learn(fb)
        chosen = self._drafts[self.chosen] if self.chosen >= 0 else Draft()
        quiet = replace(fb, drafted=0, accepted=0, accepted_path=[], draft_seconds=0.0, verify_seconds=0.0)
        for i, m in enumerate(self.members):
            if i == self.chosen:
                m.feedback(fb)
            else:
                if isinstance(m, HistoryDrafter):
                    m.observe_verified(chosen)
                m.feedback(quiet)
        self._drafts = [Draft()] * len(self.members)
        self.chosen = -1

    def end(self) -> None:
        for m in self.members:
            m.end()
