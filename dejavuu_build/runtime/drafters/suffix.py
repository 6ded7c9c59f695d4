"""Retrieval drafters over the token suffix index: REST, SuffixDecoding, SAM decoding and
their adaptive forms. They differ only in which indices they search and how they size
drafts; matching, candidate collection and tree building are shared here."""

from __future__ import annotations

from pathlib import Path

from .base import Draft, DraftBudget
from .datastore import Datastore, as_datastore
from .history import HistoryDrafter, register
from .sizing import CalibratedSizer, CostAwareSizer, Sizer
from .suffix_index import SEP, SuffixIndex
from .trees import continuation_tree

DatastoreLike = Datastore | str | Path | None


class SuffixRetrieval(HistoryDrafter):
    """Draft from whichever source index holds the longest match of the context's tail.

    The draft is a frequency trie over the continuations of up to ``max_candidates``
    occurrences of that match (latest first); nodes whose share of the occurrences is below
    ``min_score`` are dropped. ``live`` sources hold the current request, so their copies may
    run past the end of the context (periodic extension, see ``SuffixIndex.continuation``).
    """

    def __init__(
        self,
        *,
        max_match: int = 32,
        min_match: int = 1,
        max_candidates: int = 32,
        min_score: float = 0.0,
        depth_decay: float = 0.8,
        sizer: Sizer | None = None,
    ):
        super().__init__(sizer)
        self.max_match, self.min_match, self.max_candidates = max_match, min_match, max_candidates
        self.min_score, self.depth_decay = min_score, depth_decay

    def _sources(self) -> list[tuple[SuffixIndex, bool]]:
        """``(index, live)`` pairs; on equal match length the later one wins."""
        return []

    def _draft(self, budget: DraftBudget) -> Draft:
        query = self._hist[-self.max_match :]
        best_len, best = 0, None
        for index, live in self._sources():
            length = index.longest_match(query, self.min_match, self.max_match)
            if length and length >= best_len:
                best_len, best = length, (index, live)
        if best is None:
            return Draft()
        index, live = best
        self.match_len = best_len
        nodes, depth = self.sizer.size(budget, best_len)
        if nodes <= 0:
            return Draft()
        ends = index.match_ends(query[-best_len:], limit=self.max_candidates)
        seqs = [index.continuation(e, depth, periodic=live) for e in ends]
        return continuation_tree(
            seqs,
            [1.0] * len(seqs),
            budget,
            max_nodes=nodes,
            max_depth=depth,
            min_score=self.min_score,
            depth_decay=self.depth_decay,
        )


@register("rest")
class Rest(SuffixRetrieval):
    """REST: retrieval from a static datastore. The longest suffix of the context found in the
    datastore selects occurrences; their continuations form a frequency trie (chain = the
    most frequent path).

    Wins when outputs resemble a corpus you have (domain QA, code in a known codebase, a
    fixed chat style) and the context itself has little to copy. Loses off-domain, and
    costs memory proportional to the datastore. Without a datastore it never drafts.
    """

    uses_datastore = True

    def __init__(self, datastore: DatastoreLike = None, *, min_match: int = 2, **kwargs):
        super().__init__(min_match=min_match, **kwargs)
        self.datastore = as_datastore(datastore)

    def _sources(self):
        return [(self.datastore.index, False)]


@register("suffix_decoding")
class SuffixDecoding(SuffixRetrieval):
    """SuffixDecoding: one online suffix index over everything this instance has seen (prompts
    and outputs of past requests, plus the current request as it grows). Draft size is capped
    at ``spec_factor * match_len`` and unlikely branches (share < ``min_score``) are pruned,
    so confident long matches draft long and weak ones draft little.

    Wins on repetitive workloads across requests (agents, batch jobs with shared templates,
    multi-turn chat re-quoting earlier turns) and on anything ``pld`` wins on. Loses on
    one-off novel text; the history is trimmed to ``max_history`` tokens.
    """

    def __init__(
        self,
        *,
        spec_factor: float | None = 1.0,
        min_score: float = 0.1,
        max_history: int = 1_000_000,
        sizer: Sizer | None = None,
        **kwargs,
    ):
        super().__init__(min_score=min_score, sizer=sizer or Sizer(spec_factor), **kwargs)
        self.max_history = max_history
        self._global = SuffixIndex(max_len=self.max_match)

    def _reset(self) -> None:
        self._close_document()

    def _on_tokens(self, tokens: list[int]) -> None:
        self._global.extend(tokens)

    def _finish(self) -> None:
        self._close_document()

    def _close_document(self) -> None:
        self._global.end_document()
        tokens = self._global.tokens
        if len(tokens) > self.max_history:  # keep the newest half, cut at a document start
            start = len(tokens) - self.max_history // 2
            while start < len(tokens) and tokens[start - 1] != SEP:
                start += 1
            self._global = SuffixIndex(tokens[start:], max_len=self.max_match)

    def _sources(self):
        return [(self._global, True)]


@register("sam_decoding")
class SamDecoding(SuffixRetrieval):
    """SAM decoding: a static datastore index plus a live index of the current request
    (prompt and generation); drafts from whichever gives the longer match (the live one on
    ties). The original uses suffix automata; a suffix index answers the same queries.

    Wins when both the corpus and the context are useful (RAG over a known corpus, code
    completion with a repository datastore); degrades gracefully to ``pld``-like drafting.
    """

    uses_datastore = True

    def __init__(self, datastore: DatastoreLike = None, **kwargs):
        super().__init__(**kwargs)
        self.datastore = as_datastore(datastore)
        self._live = SuffixIndex(max_len=self.max_match)

    def _reset(self) -> None:
        self._live = SuffixIndex(max_len=self.max_match)

    def _on_tokens(self, tokens: list[int]) -> None:
        self._live.extend(tokens)

    def _sources(self):
        return [(self.datastore.index, False), (self._live, True)]


@register("asam")
class AdaptiveSam(SamDecoding):
    """Adaptive SAM decoding: ``sam_decoding`` whose draft depth is capped where the
    acceptance calibrated for this match length says a token is unlikely to be reached
    (see ``CalibratedSizer``). Wins when verify cost grows with drafted tokens and match
    quality varies a lot; on a memory-bound GPU the cap mostly stays at the budget."""

    def __init__(self, datastore: DatastoreLike = None, *, tau: float = 0.15, **kwargs):
        kwargs.setdefault("sizer", CalibratedSizer(tau=tau))
        super().__init__(datastore, **kwargs)


@register("asam_verify")
class AdaptiveSamVerify(AdaptiveSam):
    """``asam`` that also fits verify time ``a + b*n`` from ``Feedback.verify_seconds`` and
    drafts the ``n`` maximising expected tokens per second (see ``CostAwareSizer``).
    Wins on compute-bound verification (CPU, large trees) where every drafted token costs."""

    def __init__(self, datastore: DatastoreLike = None, *, tau: float = 0.15, **kwargs):
        kwargs.setdefault("sizer", CostAwareSizer(tau=tau))
        super().__init__(datastore, **kwargs)


@register("asd")
class AdaptiveSuffixDecoding(SuffixDecoding):
    """Adaptive suffix decoder: ``asam`` without a datastore -- the online global history of
    ``suffix_decoding`` with the calibrated depth cap instead of the fixed spec factor."""

    def __init__(self, *, tau: float = 0.15, min_score: float = 0.0, **kwargs):
        kwargs.setdefault("sizer", CalibratedSizer(tau=tau))
        super().__init__(spec_factor=None, min_score=min_score, **kwargs)


@register("asd_verify")
class AdaptiveSuffixDecodingVerify(AdaptiveSuffixDecoding):
    """``asd`` sized by measured verify cost (see ``CostAwareSizer``)."""

    def __init__(self, *, tau: float = 0.15, **kwargs):
        kwargs.setdefault("sizer", CostAwareSizer(tau=tau))
        super().__init__(tau=tau, **kwargs)
