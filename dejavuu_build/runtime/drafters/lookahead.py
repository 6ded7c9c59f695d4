"""Lookahead decoding's n-gram pool, filled from the context instead of Jacobi iterations."""

from __future__ import annotations

from collections import OrderedDict

from .base import Draft, DraftBudget
from .history import HistoryDrafter, register
from .sizing import Sizer
from .trees import continuation_tree


@register("lookahead")
class Lookahead(HistoryDrafter):
    """Lookahead decoding's verification branch: an n-gram pool keyed by the last 2 (or 1)
    tokens, each key holding up to ``pool_size`` distinct ``ngram - 1``-token continuations
    with their counts, evicted least-recently-seen first. The candidates for the current key
    become tree branches (count-weighted, latest first on ties); the chain is the best one.

    The lookahead (Jacobi) branch needs the model's own parallel guesses, which a token-only
    drafter does not see, so here the pool is built from the prompt and committed tokens.
    Wins like ``pld`` on repetitive text, and over it when a short key has several known
    continuations (tree mode verifies them all at once); loses on novel text.
    """

    def __init__(
        self,
        ngram: int = 8,
        key_lens: tuple[int, ...] = (2, 1),
        pool_size: int = 8,
        depth_decay: float = 0.8,
        sizer: Sizer | None = None,
    ):
        super().__init__(sizer)
        if ngram < 2 or not key_lens or min(key_lens) < 1:
            raise ValueError("lookahead needs ngram >= 2 and key lengths >= 1")
        self.ngram, self.key_lens, self.pool_size = ngram, tuple(sorted(key_lens, reverse=True)), pool_size
        self.depth_decay = depth_decay
        self._pool: dict[tuple[int, ...], OrderedDict[tuple[int, ...], int]] = {}

    def _reset(self) -> None:
        self._pool = {}

    def _on_tokens(self, tokens: list[int]) -> None:
        h, span = self._hist, self.ngram - 1
        for end in range(len(h) - len(tokens), len(h)):
            j = end - span  # last key token; continuation is h[j+1 : end+1]
            if j < 0:
                continue
            cont = tuple(h[j + 1 : end + 1])
            for k in self.key_lens:
                if j - k + 1 < 0:
                    continue
                bucket = self._pool.setdefault(tuple(h[j - k + 1 : j + 1]), OrderedDict())
                bucket[cont] = bucket.pop(cont, 0) + 1
                if len(bucket) > self.pool_size:
                    bucket.popitem(last=False)

    def _draft(self, budget: DraftBudget) -> Draft:
        for k in self.key_lens:
            bucket = self._pool.get(tuple(self._hist[-k:])) if len(self._hist) >= k else None
            if bucket:
                break
        else:
            return Draft()
        self.match_len = k
        nodes, depth = self.sizer.size(budget, k)
        seqs = [cont[:depth] for cont in reversed(bucket)]
        weights = [bucket[cont] for cont in reversed(bucket)]
        return continuation_tree(seqs, weights, budget, max_nodes=nodes, max_depth=depth, depth_decay=self.depth_decay)
