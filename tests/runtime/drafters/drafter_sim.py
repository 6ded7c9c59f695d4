"""Deterministic fake models and a tiny greedy reference engine for drafter tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dejavuu_build.runtime.drafters import Draft, DraftBudget, Drafter, Feedback


class MarkovModel:
    """Greedy next token = a fixed random function of the last 3 tokens.

    The state space is finite, so generation falls into a cycle after ~100 tokens: repetitive
    text on which retrieval drafters must accept tokens.
    """

    def __init__(self, vocab: int = 16, seed: int = 0, k: int = 4, hidden_dim: int = 24):
        rng = np.random.default_rng(seed)
        self.vocab, self.k, self.hidden_dim = vocab, k, hidden_dim
        self.table = rng.integers(0, vocab, size=(vocab, vocab, vocab))
        self._states: dict[tuple[int, ...], np.ndarray] = {}

    def _key(self, ctx: Sequence[int]) -> tuple[int, ...]:
        return tuple(([0, 0, 0] + [int(t) for t in ctx[-3:]])[-3:])

    def next(self, ctx: Sequence[int]) -> int:
        return int(self.table[self._key(ctx)])

    def topk(self, ctx: Sequence[int]) -> list[int]:
        g = self.next(ctx)
        return [g] + [(g + 1 + 5 * i) % self.vocab for i in range(self.k - 1)]

    def hidden(self, ctx: Sequence[int]) -> np.ndarray:
        key = self._key(ctx)
        if key not in self._states:
            self._states[key] = np.random.default_rng(list(key)).standard_normal(self.hidden_dim).astype(np.float32)
        return self._states[key]

    def generate(self, prompt: Sequence[int], n: int) -> list[int]:
        ctx = list(prompt)
        for _ in range(n):
            ctx.append(self.next(ctx))
        return ctx[len(prompt) :]


class OracleModel(MarkovModel):
    """Follows a fixed token sequence (then repeats its last token): ground truth for any text."""

    def __init__(self, seq: Sequence[int], k: int = 4, hidden_dim: int = 24):
        self.vocab, self.k, self.hidden_dim = max(seq) + 2 * k, k, hidden_dim
        self._states = {}
        self.seq = [int(t) for t in seq]

    def next(self, ctx: Sequence[int]) -> int:
        return self.seq[len(ctx)] if len(ctx) < len(self.seq) else self.seq[-1]


def verify(model: MarkovModel, context: list[int], draft: Draft, *, verify_a=1e-3, verify_b=1e-4) -> Feedback:
    """Greedy lossless verification: accept the longest draft path the model agrees with."""
    kids = {(p, t): i for i, (t, p) in enumerate(zip(draft.tokens, draft.parents))}
    path: list[int] = []
    committed: list[int] = []
    node, ctx = -1, list(context)
    while True:
        g = model.next(ctx)
        committed.append(g)
        node = kids.get((node, g))
        if node is None:
            break
        path.append(node)
        ctx.append(g)

    def prefix(i: int) -> list[int]:
        toks = []
        while i >= 0:
            toks.append(draft.tokens[i])
            i = draft.parents[i]
        return toks[::-1]

    topk = np.array([model.topk(context)] + [model.topk(context + prefix(i)) for i in range(len(draft))])
    hidden = np.stack([model.hidden(context + committed[:j]) for j in range(len(committed))])
    return Feedback(
        committed=committed,
        drafted=len(draft),
        accepted=len(path),
        accepted_path=path,
        topk_ids=topk,
        hidden=hidden,
        draft_seconds=1e-5,
        verify_seconds=verify_a + verify_b * len(draft),
    )


@dataclass
class RunStats:
    generated: list[int] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0
    drafted: int = 0
    branched: bool = False

    @property
    def mean_accepted(self) -> float:
        return self.accepted / max(self.steps, 1)


def run(drafter: Drafter, model: MarkovModel, prompt: Sequence[int], n_new: int, budget: DraftBudget) -> RunStats:
    """Generate ``n_new`` tokens with speculative decoding, checking every draft on the way."""
    stats = RunStats()
    ctx = [int(t) for t in prompt]
    drafter.begin(list(ctx))
    while len(ctx) - len(prompt) < n_new:
        draft = drafter.propose(list(ctx), budget)
        draft.validate(budget)
        assert budget.tree or draft.is_chain(), f"{drafter.name} returned a tree in chain mode"
        stats.branched |= not draft.is_chain()
        fb = verify(model, ctx, draft)
        ctx.extend(fb.committed)
        drafter.feedback(fb)
        stats.steps += 1
        stats.accepted += fb.accepted
        stats.drafted += fb.drafted
    drafter.end()
    stats.generated = ctx[len(prompt) :][:n_new]
    return stats
