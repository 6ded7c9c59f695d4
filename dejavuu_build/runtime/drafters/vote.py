"""``suffix_vote``: copy the continuation that the occurrences of several suffix lengths agree on, as
far as its measured acceptance pays for the rows it costs.

Why: on a rowwise CPU decoder every drafted token costs a graph row (a second row +17-48%), so a
draft pays only where it is likely to be accepted. ``suffix_decoding`` copies from the occurrences of
the longest matching suffix only, up to a fixed length; measured against the copy oracle (docs/
methods.md) about half of what it leaves is "which occurrence to copy and how far".
"""

from __future__ import annotations

from .base import Draft, DraftBudget, Feedback
from .history import register
from .sizing import RowCosts
from .suffix import SuffixDecoding
from .suffix_index import SEP

L_EDGES = (1, 2, 3, 5, 8, 12, 16, 24)  # effective match length buckets: <=1, 2, 3, 4-5, 6-8, 9-12, 13-16, 17-24, 25+
SHARE_EDGES = (0.3, 0.5, 0.7, 0.9, 0.999)  # the drafted token's share of the agreeing occurrences' weight


def _bucket(x: float, edges: tuple) -> int:
    for i, top in enumerate(edges):
        if x <= top:
            return i
    return len(edges)


class Hazard:
    """Forgetful acceptance per feature cell: the chance a drafted token is accepted given the tokens
    before it were. A cell is a tuple of features, most telling first; its estimate is shrunk toward
    the cell of its first ``k - 1`` features, down to the first feature's, and that toward a prior
    that grows with it (the match length bucket)."""

    def __init__(self, forget: float = 0.999, weight: float = 4.0):
        self.forget, self.weight = forget, weight
        self.hit: dict[tuple, float] = {}
        self.seen: dict[tuple, float] = {}
        self._n = 0

    @staticmethod
    def prior(lb: int) -> float:
        return min(0.2 + 0.1 * lb, 0.9)

    def alpha(self, cell: tuple) -> float:
        p = self.prior(cell[0])
        for k in range(1, len(cell) + 1):
            key = cell[:k]
            p = (self.hit.get(key, 0.0) + p * self.weight) / (self.seen.get(key, 0.0) + self.weight)
        return p

    def learn(self, cell: tuple, ok: bool) -> None:
        self._n += 1
        if self._n % 256 == 0:  # forget in batches: the same decay, without touching every cell each time
            f = self.forget**256
            for d in (self.hit, self.seen):
                for cell_key in d:
                    d[cell_key] *= f
        for k in range(1, len(cell) + 1):
            key = cell[:k]
            self.seen[key] = self.seen.get(key, 0.0) + 1.0
            if ok:
                self.hit[key] = self.hit.get(key, 0.0) + 1.0


@register("suffix_vote")
class SuffixVote(SuffixDecoding):
    """Suffix decoding whose chain is voted by every occurrence of the context's matching suffixes and
    cut where the measured acceptance stops paying for the measured row costs.

    Candidates are the occurrences (latest first, ``max_candidates`` each) of the longest suffix of
    the context found in the history (every earlier request's prompt and output plus this request
    so far, as ``suffix_decoding``) and of its last ``short`` tokens; each is weighted by
    ``length ** power`` of its own match with the context (``live`` times more inside this
    request). Each level drafts the token with the most weight among the occurrences that agreed
    with every level before it. A level's chance of acceptance is learnt per cell (the longest
    agreeing match, the longest inside this request, the token's share of the weight, whether the
    model's own last output after the token before it was this token, one or several occurrences),
    from every chain
    built, scored against the tokens committed after it (so levels never verified are learnt too);
    the chain is cut at the depth maximising ``(1 + expected accepted) / verify time(rows)``, with
    verify time measured per row count (``Feedback.verify_seconds``, ``Feedback.rows``): depth 0,
    nothing drafted, where a lone token is one row and no level pays for its row. Always a chain,
    whatever the budget (see ``_draft``).
    """

    sizes_itself = True  # auto plays its drafts as cut (see Auto._best_cut)

    def __init__(
        self,
        *,
        max_candidates: int = 24,
        short: int = 2,
        power: float = 2.0,
        live: float = 4.0,
        forget: float = 0.999,
        prior_weight: float = 4.0,
        sized: bool = True,
        **kwargs,
    ):
        kwargs.setdefault("min_score", 0.0)
        super().__init__(spec_factor=None, max_candidates=max_candidates, **kwargs)
        self.short, self.power, self.live = short, power, live
        self.sized = sized
        self.hazard = Hazard(forget, prior_weight)
        self.costs = RowCosts()
        self._live_start = 0
        self._pending: list[tuple[int, list[int], list[tuple]]] = []  # (history position, chain, cells)
        self.cut = 0  # the depth the latest chain was cut to
        # token -> the token the model last produced after it (its outputs only, every request)
        self._succ: dict[int, int] = {}
        self._prompt_len = 0

    # -- history ---------------------------------------------------------------------------------
    def begin(self, prompt_ids) -> None:
        self._prompt_len = len(prompt_ids)
        super().begin(prompt_ids)

    def _reset(self) -> None:
        super()._reset()
        self._live_start = len(self._global.tokens)
        self._pending = []

    def _on_tokens(self, tokens: list[int]) -> None:
        super()._on_tokens(tokens)
        h = self._hist
        for i in range(max(len(h) - len(tokens), self._prompt_len, 1), len(h)):
            self._succ[h[i - 1]] = h[i]
        if self._pending:
            self._score()

    def _finish(self) -> None:
        self._score(final=True)
        super()._finish()

    def _score(self, final: bool = False) -> None:
        """Learn from every chain whose levels the committed tokens now decide."""
        h, keep = self._hist, []
        for pos, chain, cells in self._pending:
            truth = h[pos : pos + len(chain)]
            j = 0
            while j < len(truth) and truth[j] == chain[j]:
                j += 1
            if j < len(truth) or len(truth) == len(chain) or final:
                for k in range(min(len(truth), j + 1)):
                    self.hazard.learn(cells[k], k < j)
            else:
                keep.append((pos, chain, cells))
        self._pending = keep

    def _learn(self, fb: Feedback, start: int, verified: Draft) -> None:
        self.costs.learn(fb)

    # -- drafting --------------------------------------------------------------------------------
    def _candidates(self, depth: int) -> tuple[list[list[int]], list[float], list[int], list[bool]]:
        """Continuations of the matching occurrences, their weights, match lengths and whether each
        lies inside this request."""
        idx = self._global
        t = idx.tokens
        q = self._hist[-self.max_match :]
        best = idx.longest_match(q, self.min_match, self.max_match)
        if not best:
            return [], [], [], []
        self.match_len = best
        ends = idx.match_ends(q[-best:], limit=self.max_candidates)
        if self.short < best:
            ends = list(dict.fromkeys(ends + idx.match_ends(q[-self.short :], limit=self.max_candidates)))
        seqs, weights, lengths, live = [], [], [], []
        nq = len(q)
        for e in ends:
            n = 0
            while n < nq and e - n - 1 >= 0 and t[e - n - 1] == q[nq - n - 1] and t[e - n - 1] != SEP:
                n += 1
            seq = idx.continuation(e, depth, periodic=True)
            if not seq:
                continue
            seqs.append(seq)
            lengths.append(n)
            live.append(e >= self._live_start)
            weights.append(n**self.power * (self.live if live[-1] else 1.0))
        return seqs, weights, lengths, live

    def _draft(self, budget: DraftBudget) -> Draft:
        depth = budget.max_depth
        seqs, weights, lengths, live = self._candidates(depth)
        if not seqs:
            return Draft()
        # a tree budget gets the same cut chain: its weighted trie, uncut and verified whole, decoded
        # at 0.65-0.77x plain decoding where the chain made 1.10-1.27x (SmolLM2 int4-static vs
        # int4-rowwise, 12 Spec-Bench prompts, Xeon AVX-512 + AMX, 2026-12-05)
        chain: list[int] = []
        cells: list[tuple] = []
        active = list(range(len(seqs)))
        for j in range(min(depth, budget.max_nodes)):
            tally: dict[int, float] = {}
            for i in active:
                if len(seqs[i]) > j:
                    tok = seqs[i][j]
                    tally[tok] = tally.get(tok, 0.0) + weights[i]
            if not tally:
                break
            tok = max(tally, key=tally.__getitem__)
            share = tally[tok] / sum(tally.values())
            active = [i for i in active if len(seqs[i]) > j and seqs[i][j] == tok]
            longest = max(lengths[i] for i in active) + j
            inside = max((lengths[i] for i in active if live[i]), default=-1 - j) + j
            prev = chain[-1] if chain else self._hist[-1]
            said = self._succ.get(prev)
            agree = 1 if said is None else (2 if said == tok else 0)
            cells.append(
                (
                    _bucket(longest, L_EDGES),
                    _bucket(inside, L_EDGES) if inside >= 0 else -1,
                    _bucket(share, SHARE_EDGES),
                    agree,
                    min(len(active), 2),
                )
            )
            chain.append(tok)
        if not chain:
            return Draft()
        self._pending.append((len(self._hist), chain, cells))
        n = self._cut(cells) if self.sized else len(chain)
        self.cut = n
        return Draft.chain(chain[:n])

    def _cut(self, cells: list[tuple]) -> int:
        """The depth maximising ``(1 + E[accepted]) / verify time(rows)`` (0: draft nothing)."""
        c = self.costs
        best_n, best = 0, 1.0 / c.seconds(0)
        e = surv = 1.0
        for n, cell in enumerate(cells, 1):
            surv *= self.hazard.alpha(cell)
            e += surv
            rate = e / c.seconds(n)
            if rate > best:
                best_n, best = n, rate
        return best_n
