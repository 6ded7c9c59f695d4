"""Token Recycling: reuse the verifier's discarded top-k candidates as a successor table."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from .base import Draft, DraftBudget, Feedback
from .history import HistoryDrafter, register
from .sizing import Sizer
from .trees import best_first

DEFAULT_RANK_PROBS = (0.6, 0.15, 0.08, 0.05, 0.04, 0.03, 0.025, 0.02)


@register("token_recycling")
class TokenRecycling(HistoryDrafter):
    """Keep an adjacency table ``token -> its latest verifier top-k successors`` and draft by
    best-first expansion from the last token through it (a chain is the top-1 walk).

    Every verify step refreshes the rows of all input tokens: row 0 of
    ``Feedback.topk_ids`` is the top-k after the root (the last context token before the
    step), row ``i + 1`` the top-k after draft node ``i`` -- including rejected nodes, which
    is the "recycling". A child's conditional probability is a fixed prior by rank
    (``rank_probs``). The table outlives requests, so it warms up across a session.

    Wins on open-ended text where nothing is copied but local continuations recur (chat,
    instructions, any language); costs the engine a top-k per verified node. Loses when the
    successor of a token depends on more than the token itself.
    """

    wants_topk = True

    def __init__(self, topk: int = 8, rank_probs: Sequence[float] = DEFAULT_RANK_PROBS, sizer: Sizer | None = None):
        super().__init__(sizer)
        self.topk = topk
        self.rank_probs = tuple(rank_probs)
        self._table: dict[int, tuple[int, ...]] = {}

    def _learn(self, fb: Feedback, start: int, verified: Draft) -> None:
        if fb.topk_ids is None or start <= 0:
            return
        rows = np.asarray(fb.topk_ids).reshape(len(fb.topk_ids), -1)[:, : self.topk].tolist()
        inputs = [self._hist[start - 1]] + verified.tokens[: len(rows) - 1]
        for tok, row in zip(inputs, rows):
            self._table[tok] = tuple(int(t) for t in row if t >= 0)

    def _children(self, tok: int) -> Iterator[tuple[int, float, int]]:
        probs = self.rank_probs
        return ((t, probs[r] if r < len(probs) else probs[-1], t) for r, t in enumerate(self._table.get(tok, ())))

    def _draft(self, budget: DraftBudget) -> Draft:
        root = self._hist[-1]
        if root not in self._table:
            return Draft()
        nodes, depth = self.sizer.size(budget, 1)
        return best_first(root, self._children, budget, max_nodes=nodes, max_depth=depth)
