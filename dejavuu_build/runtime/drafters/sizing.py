"""Draft sizing policies: how many nodes and how deep to draft this step.

Drafters find candidates; a :class:`Sizer` decides how much of them is worth verifying. The
policies here are shared: a fixed budget (optionally proportional to the match length, as in
SuffixDecoding), additive-increase / shrink-toward-accepted (ANPD), acceptance calibrated per
match length (adaptive SAM), and the same plus a fitted verify-cost model (the ``_verify``
variants and ``auto``).
"""

from __future__ import annotations

import math

from .base import Draft, DraftBudget, Feedback


class Sizer:
    """Use the whole budget, optionally capped at ``ceil(spec_factor * match_len)`` nodes."""

    def __init__(self, spec_factor: float | None = None):
        self.spec_factor = spec_factor

    def size(self, budget: DraftBudget, match_len: int) -> tuple[int, int]:
        nodes = budget.max_nodes
        if self.spec_factor is not None:
            nodes = min(nodes, max(1, math.ceil(self.spec_factor * match_len)))
        return nodes, budget.max_depth

    def learn(self, fb: Feedback, verified: Draft) -> None:
        """Called after every step; ``fb.drafted == 0`` when this drafter's draft was not verified."""


def _chain_or_tree(budget: DraftBudget, depth: int) -> tuple[int, int]:
    depth = max(1, min(depth, budget.max_depth))
    return (budget.max_nodes if budget.tree else min(depth, budget.max_nodes)), depth


class AimdSizer(Sizer):
    """Grow the draft length after a fully accepted draft, shrink it toward what was accepted.

    Cheap and reactive: long drafts in repetitive stretches, short ones elsewhere.
    """

    def __init__(self, start: int = 4, grow: int = 2, min_len: int = 1, max_len: int = 64):
        super().__init__()
        self.length, self.grow, self.min_len, self.max_len = start, grow, min_len, max_len

    def size(self, budget: DraftBudget, match_len: int) -> tuple[int, int]:
        return _chain_or_tree(budget, self.length)

    def learn(self, fb: Feedback, verified: Draft) -> None:
        if fb.drafted <= 0:
            return
        depth = verified.depth() or fb.drafted
        if fb.accepted >= depth:
            self.length = min(self.max_len, self.length + self.grow)
        else:
            self.length = max(self.min_len, (self.length + fb.accepted + 1) // 2)


class CalibratedSizer(Sizer):
    """Cap the draft depth where the calibrated chance of still being accepted drops below ``tau``.

    Per match-length bucket it keeps a forgetful Beta estimate of ``alpha``, the chance that
    the next draft level is accepted given the previous one was; depth ``n`` is kept while
    ``alpha ** n >= tau``. Long suffix matches earn long drafts, short ones short drafts.
    """

    def __init__(
        self, tau: float = 0.15, prior_alpha: float = 0.7, prior_weight: float = 4.0, forget: float = 0.995, **kwargs
    ):
        super().__init__(**kwargs)
        self.tau, self.prior_alpha, self.prior_weight, self.forget = tau, prior_alpha, prior_weight, forget
        self._hits: dict[int, float] = {}
        self._misses: dict[int, float] = {}
        self._bucket = 0

    @staticmethod
    def bucket(match_len: int) -> int:
        return min(max(match_len, 0).bit_length(), 6)  # 0, 1, 2-3, 4-7, 8-15, 16-31, 32+

    def alpha(self, match_len: int) -> float:
        b = self.bucket(match_len)
        hits, misses = self._hits.get(b, 0.0), self._misses.get(b, 0.0)
        return (hits + self.prior_alpha * self.prior_weight) / (hits + misses + self.prior_weight)

    def expected_accepted(self, alpha: float, n: int) -> float:
        """Expected accepted tokens of an ``n``-long chain: ``sum_{j<=n} alpha^j``."""
        return n if alpha >= 1 else alpha * (1 - alpha**n) / (1 - alpha)

    def size(self, budget: DraftBudget, match_len: int) -> tuple[int, int]:
        self._bucket = self.bucket(match_len)
        a = self.alpha(match_len)
        depth = budget.max_depth if a >= 1 else int(math.log(self.tau) / math.log(max(a, 1e-6)))
        nodes, depth = _chain_or_tree(budget, depth)
        base_nodes, _ = super().size(budget, match_len)
        return min(nodes, base_nodes), depth

    def learn(self, fb: Feedback, verified: Draft) -> None:
        if fb.drafted <= 0:
            return
        depth = verified.depth() or fb.drafted
        b = self._bucket
        for d in (self._hits, self._misses):
            for k in d:
                d[k] *= self.forget
        self._hits[b] = self._hits.get(b, 0.0) + min(fb.accepted, depth)
        self._misses[b] = self._misses.get(b, 0.0) + (1.0 if fb.accepted < depth else 0.0)


class VerifyCostModel:
    """Forgetful least-squares fit of verify time ``t(n) = a + b*n`` over a step's graph rows
    beyond the first (``learn``), or over any count fed to ``observe``.

    ``single_rows`` is what a lone token costs: 2 until a step with no draft reports 1
    (``Feedback.rows``: a rowwise decoder, which has no pad row); ``extra_rows(n)`` is then what
    an ``n``-node draft costs beyond it."""

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self._s = [0.0] * 5  # sum w, sum n, sum n^2, sum t, sum n*t
        self.draft_seconds = 0.0
        self.single_rows = 2

    def learn(self, fb: Feedback) -> None:
        """One verify step: its rows (learning ``single_rows`` from a step with no draft) and time."""
        if fb.drafted == 0 and fb.rows:
            self.single_rows = min(self.single_rows, fb.rows)
        self.observe(self.extra_rows((fb.rows or fb.drafted + 1) - 1), fb.verify_seconds, fb.draft_seconds)

    def extra_rows(self, n: int) -> int:
        """Graph rows beyond the first that a step drafting ``n`` chain nodes runs."""
        return max(n + 1, self.single_rows) - 1

    def observe(self, n: int, seconds: float, draft_seconds: float = 0.0) -> None:
        if seconds <= 0:
            return
        f = self.forget
        s = [x * f for x in self._s]
        s[0] += 1
        s[1] += n
        s[2] += n * n
        s[3] += seconds
        s[4] += n * seconds
        self._s = s
        self.draft_seconds = f * self.draft_seconds + (1 - f) * draft_seconds if s[0] > 1 else draft_seconds

    @property
    def ready(self) -> bool:
        return self._s[0] >= 3

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``; with no spread in ``n`` yet, ``b = 0`` (optimism that explores longer drafts)."""
        w, sn, snn, st, snt = self._s
        if w <= 0:
            return 0.0, 0.0
        var = snn * w - sn * sn
        b = (snt * w - sn * st) / var if var > 1e-9 * max(w * w, 1.0) else 0.0
        b = max(b, 0.0)
        a = max((st - b * sn) / w, 1e-9)
        return a, b

    def predict(self, n: int) -> float:
        a, b = self.coefficients()
        return a + b * n + self.draft_seconds


class CostAwareSizer(CalibratedSizer):
    """Pick the draft size that maximises expected tokens per second.

    ``(1 + E[accepted | n]) / (draft + a + b*(rows(n) - 1))``, with ``alpha`` from the calibration,
    ``a, b`` fitted to ``Feedback.verify_seconds`` over the graph rows each step ran, and
    ``rows(n) = max(n + 1, single_rows)``. Wins when verification cost grows with the number of
    drafted tokens (compute-bound CPU inference, big trees); falls back to the calibrated cap until
    a few timings have been seen. Where a lone token runs as two rows (padded decoders), one draft
    node is free, so it never drafts less than one; where it runs as one row (rowwise decoders,
    learnt from ``Feedback.rows``), a node must earn its row, and an unpromising match drafts
    nothing — except every ``explore``-th such step, which drafts anyway so that ``alpha`` of a
    match length that once looked hopeless stays current.
    """

    def __init__(self, explore: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.cost = VerifyCostModel()
        self.explore = explore
        self._skipped = 0

    @property
    def single_rows(self) -> int:
        return self.cost.single_rows

    def size(self, budget: DraftBudget, match_len: int) -> tuple[int, int]:
        nodes, depth = super().size(budget, match_len)
        if not self.cost.ready or budget.max_nodes < 1:
            return nodes, depth
        alpha = self.alpha(match_len)
        a, b = self.cost.coefficients()
        fixed = a + self.cost.draft_seconds

        def rate(n: int) -> float:
            return (1 + self.expected_accepted(alpha, min(n, budget.max_depth))) / (fixed + b * self.cost.extra_rows(n))

        best_n = max(range(1, budget.max_nodes + 1), key=rate)
        if self.single_rows == 1 and rate(0) > rate(best_n):
            self._skipped += 1
            if self._skipped % self.explore:
                return 0, 0
        return best_n, min(best_n, budget.max_depth)

    def learn(self, fb: Feedback, verified: Draft) -> None:
        super().learn(fb, verified)
        self.cost.learn(fb)
