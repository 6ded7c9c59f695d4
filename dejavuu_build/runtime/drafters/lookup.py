"""Prompt-lookup drafters: copy what followed an earlier occurrence of the context's tail."""

from __future__ import annotations

import numpy as np

from .base import Draft, DraftBudget, Feedback
from .history import HiddenStore, HistoryDrafter, register
from .sizing import AimdSizer, Sizer
from .suffix_index import SuffixIndex
from .trees import continuation_tree


@register("pld")
class PromptLookup(HistoryDrafter):
    """Prompt lookup decoding: find the longest n-gram (``max_ngram`` down to ``min_ngram``)
    ending the context that occurred earlier in the context, and copy what followed it.

    Candidates are ordered longest match first, then most recent, and weighted geometrically
    (``recency ** rank``, 0.5 makes the first strictly dominant), so the chain copies the
    latest longest match and tree mode branches over the distinct continuations of the
    others. A continuation that runs into the end of the context is extended periodically.

    Wins when the output copies its input: summarisation, RAG, code editing, rewriting, and
    repetition loops. Loses on open-ended generation, where matches are short and wrong.
    """

    def __init__(
        self,
        max_ngram: int = 4,
        min_ngram: int = 1,
        max_matches: int = 8,
        recency: float = 0.5,
        depth_decay: float = 0.8,
        sizer: Sizer | None = None,
    ):
        super().__init__(sizer)
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self.recency, self.depth_decay = recency, depth_decay
        self._index = SuffixIndex(max_len=max_ngram)

    def _reset(self) -> None:
        self._index = SuffixIndex(max_len=self.max_ngram)

    def _on_tokens(self, tokens: list[int]) -> None:
        self._index.extend(tokens)

    def _candidates(self) -> list[tuple[int, int]]:
        """``(match_len, continuation_start)`` pairs, best first."""
        return self._index.matches(self._hist, self.min_ngram, self.max_ngram, self.max_matches)

    def _draft(self, budget: DraftBudget) -> Draft:
        cands = self._candidates()
        if not cands:
            return Draft()
        self.match_len = cands[0][0]
        nodes, depth = self.sizer.size(budget, cands[0][0])
        seqs = [self._index.continuation(e, depth, periodic=True) for _, e in cands]
        weights = [self.recency**r for r in range(len(seqs))]
        return continuation_tree(seqs, weights, budget, max_nodes=nodes, max_depth=depth, depth_decay=self.depth_decay)


@register("pld_plus")
class PromptLookupPlus(PromptLookup):
    """PLD+: prompt lookup whose candidate matches are re-ranked by hidden-state similarity.

    The engine passes hidden states of committed tokens (``Feedback.hidden``: row ``i`` is the
    state at the input that produced ``committed[i]``, i.e. the root and the accepted nodes).
    A candidate's score is ``match_len + cosine`` between the latest state and the state at
    the same offset before the candidate, so similarity decides among matches of (nearly)
    equal length. Without hidden states it is ``pld``.

    Wins over ``pld`` when a short n-gram recurs in several contexts (boilerplate, lists,
    code with repeated identifiers) and only the semantically closest one continues right.
    """

    wants_hidden = True

    def __init__(self, hidden_dim: int = 64, **kwargs):
        super().__init__(**kwargs)
        self._hidden = HiddenStore(hidden_dim)

    def _reset(self) -> None:
        super()._reset()
        self._hidden.clear()

    def _learn(self, fb: Feedback, start: int, verified: Draft) -> None:
        if fb.hidden is not None and len(fb.committed):
            rows = np.asarray(fb.hidden)[: len(fb.committed)]  # extra rows: committed was truncated
            self._hidden.put(start - 2 + len(rows), rows)

    def _offset(self) -> int:
        """Distance from the end of the history back to the latest stored state."""
        return len(self._hist) - self._hidden.latest

    def _candidates(self) -> list[tuple[int, int]]:
        cands = super()._candidates()
        if self._hidden.latest < 0 or len(cands) < 2:
            return cands
        cos = self._hidden.cosine([e - self._offset() for _, e in cands])
        score = [length + (0.0 if np.isnan(c) else float(c)) for (length, _), c in zip(cands, cos)]
        order = sorted(range(len(cands)), key=lambda i: -score[i])  # stable: ties keep recency
        return [cands[i] for i in order]


@register("adapld")
class AdaptivePromptLookup(PromptLookupPlus):
    """``pld_plus`` with a semantic fallback: when no n-gram of at least ``min_ngram`` tokens
    matches, copy the continuation of the positions whose hidden states are nearest to the
    current one; in tree mode those also fill branches the n-gram matches leave free.

    Wins when the model paraphrases earlier text (same meaning, different tokens at the
    seam), where exact lookup finds nothing. Needs hidden states; costs one ``[n, 64]``
    product per step.
    """

    def __init__(self, min_ngram: int = 2, min_cosine: float = 0.5, **kwargs):
        super().__init__(min_ngram=min_ngram, **kwargs)
        self.min_cosine = min_cosine

    def _candidates(self) -> list[tuple[int, int]]:
        cands = super()._candidates()
        if self._hidden.latest < 0 or len(cands) >= self.max_matches:
            return cands
        off, n = self._offset(), len(self._hist)
        seen = {e for _, e in cands}
        for p in self._hidden.nearest(self.max_matches, before=self._hidden.latest, min_cosine=self.min_cosine):
            e = p + off
            if 0 < e < n and e not in seen:
                seen.add(e)
                cands.append((0, e))
                if len(cands) >= self.max_matches:
                    break
        return cands


@register("anpd")
class AdaptiveNgram(PromptLookup):
    """ANPD-style adaptive n-gram drafting: prompt lookup whose draft length grows after a
    fully accepted draft and shrinks toward the accepted length after a rejection.

    Wins on text that alternates between copy-heavy stretches (long drafts pay off) and free
    generation (short drafts waste less verify compute); on a memory-bound GPU, where extra
    draft tokens are nearly free, plain ``pld`` is as good.
    """

    def __init__(self, start_len: int = 4, **kwargs):
        kwargs.setdefault("sizer", AimdSizer(start=start_len))
        super().__init__(**kwargs)
