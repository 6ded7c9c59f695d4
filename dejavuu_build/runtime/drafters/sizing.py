"""Draft sizing policies: how many nodes and how deep to draft this step.

Drafters find candidates; a :class:`Sizer` decides how much of them is worth verifying. The
policies here are shared: a fixed budget (optionally proportional to the match length, as in
SuffixDecoding), additive-increase / shrink-toward-accepted (ANPD), acceptance calibrated per
match length (adaptive SAM), and the same plus the verify-cost model (:class:`RowCosts`: verify
seconds by graph rows, learnt from feedback timings), which ``suffix_vote`` and ``auto`` price their
drafts with too.
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


# relative verify cost of a step of 1, 2, ... graph rows before any timing (a CPU's shape: the
# probes in docs/methods.md put a second row at +17-48%, 8 rows at 2.1-2.9x one)
PRIOR_ROW_COSTS = (1.0, 1.2, 1.4, 1.55, 1.7, 1.85, 2.0, 2.15, 2.3)


class RowCosts:
    """Verify seconds of a step by the graph rows it runs, learnt from ``Feedback`` timings: the one
    verify-cost model of every drafter that weighs a draft's rows against what it may gain.

    Per row count, a forgetful mean of the steps' ``verify_seconds`` (``forget`` per step of that
    count): verify time is not linear in rows on a CPU (a fifth row can be nearly free, a seventh
    dear), so a count drafted often is priced as measured. A count with few timings leans on a line
    ``a + b * (rows - 1)`` fitted by forgetful least squares (``line_forget``) to every timing,
    ``shrink`` timings' worth; with timings of one count only, on that count's mean scaled by
    ``prior``'s shape (and before any timing, on ``prior`` itself, relative units). Costs never fall
    as rows grow. ``single_rows`` is what a lone token runs: 2 until a step with no draft reports 1
    (``Feedback.rows``: a rowwise decoder, which has no pad row); ``rows(n)`` is then what an
    ``n``-node draft runs. ``draft_seconds`` is a forgetful mean of ``Feedback.draft_seconds``."""

    def __init__(
        self,
        prior: tuple[float, ...] = PRIOR_ROW_COSTS,
        *,
        forget: float = 0.95,
        line_forget: float = 0.98,
        shrink: float = 2.0,
    ):
        self.prior, self.forget, self.line_forget, self.shrink = prior, forget, line_forget, shrink
        self.mean: dict[int, float] = {}  # rows -> forgetful mean seconds
        self.weight: dict[int, float] = {}  # rows -> forgetful count of its timings
        self._s = [0.0] * 5  # the line's sums: w, x, x^2, t, x*t (x = rows - 1)
        self.draft_seconds = 0.0
        self.single_rows = 2
        self._table: list[float] = []  # cost by rows (index 0 unused), monotone; [] when stale

    # -- learning ----------------------------------------------------------------------------------
    def learn(self, fb: Feedback) -> None:
        """One verify step: its rows (learning ``single_rows`` from a step with no draft) and time."""
        if fb.drafted == 0 and fb.rows:
            self.single_rows = min(self.single_rows, fb.rows)
        self.observe(fb.rows or self.rows(fb.drafted), fb.verify_seconds, fb.draft_seconds)

    def observe(self, rows: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """A step of ``rows`` graph rows took ``seconds`` to verify (ignored unless positive)."""
        if seconds <= 0 or rows < 1:
            return
        m = self.mean.get(rows)
        f = self.forget
        self.mean[rows] = seconds if m is None else f * m + (1 - f) * seconds
        self.weight[rows] = f * self.weight.get(rows, 0.0) + 1.0
        g, x = self.line_forget, rows - 1
        s = [v * g for v in self._s]
        s[0] += 1
        s[1] += x
        s[2] += x * x
        s[3] += seconds
        s[4] += x * seconds
        self.draft_seconds = g * self.draft_seconds + (1 - g) * draft_seconds if self._s[0] > 0 else draft_seconds
        self._s = s
        self._table = []

    @property
    def ready(self) -> bool:
        """Whether a few timings have been seen (before that, costs are ``prior``'s relative units)."""
        return self._s[0] >= 3

    # -- prices ------------------------------------------------------------------------------------
    def rows(self, drafted: int) -> int:
        """Graph rows of a step drafting ``drafted`` chain nodes."""
        return max(drafted + 1, self.single_rows)

    def cost(self, rows: int) -> float:
        """Seconds (relative units before any timing) of a step of ``rows`` graph rows."""
        table = self._table or self._build()
        if rows < len(table):
            return table[max(rows, 1)]
        return max(self._line(rows, self._fit()), table[-1])

    def seconds(self, drafted: int) -> float:
        """Verify seconds of a step drafting ``drafted`` chain nodes."""
        return self.cost(self.rows(drafted))

    def _prior(self, rows: int) -> float:
        p = self.prior
        return p[min(rows, len(p)) - 1] + (p[-1] - p[-2]) * max(0, rows - len(p))

    def _fit(self) -> tuple[float, float, int]:
        """The line's ``(a, b, 0)``, or ``(mean, 0, rows)`` when one row count holds every timing
        (its mean in the prior's shape), or ``(1, 0, 1)`` before any timing (the prior)."""
        w, sx, sxx, st, sxt = self._s
        if w <= 0:
            return 1.0, 0.0, 1
        var = sxx * w - sx * sx
        if var <= 1e-9 * max(w * w, 1.0):
            x = max(self.mean, key=self.weight.__getitem__)
            return self.mean[x], 0.0, x
        b = max((sxt * w - sx * st) / var, 0.0)
        return (st - b * sx) / w, b, 0

    def _line(self, rows: int, fit: tuple[float, float, int]) -> float:
        a, b, x = fit
        if x:
            return a * self._prior(rows) / self._prior(x)
        return max(a + b * (rows - 1), 1e-9)

    def _build(self) -> list[float]:
        fit = self._fit()
        out = [0.0]
        for r in range(1, max(len(self.prior), max(self.mean, default=0)) + 1):
            line = self._line(r, fit)
            k = self.weight.get(r, 0.0)
            c = (k * self.mean[r] + self.shrink * line) / (k + self.shrink) if k else line
            out.append(max(c, out[-1]))
        self._table = out
        return out


class CostAwareSizer(CalibratedSizer):
    """Pick the draft size that maximises expected tokens per second.

    ``(1 + E[accepted | n]) / (draft + verify(rows(n)))``, with ``alpha`` from the calibration,
    ``verify`` the :class:`RowCosts` learnt from ``Feedback.verify_seconds`` over the graph rows each
    step ran, and ``rows(n) = max(n + 1, single_rows)``. Wins when verification cost grows with the number of
    drafted tokens (compute-bound CPU inference, big trees); falls back to the calibrated cap until
    a few timings have been seen. Where a lone token runs as two rows (padded decoders), one draft
    node is free, so it never drafts less than one; where it runs as one row (rowwise decoders,
    learnt from ``Feedback.rows``), a node must earn its row, and an unpromising match drafts
    nothing — except every ``explore``-th such step, which drafts anyway so that ``alpha`` of a
    match length that once looked hopeless stays current.
    """

    def __init__(self, explore: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.cost = RowCosts()
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
        c = self.cost

        def rate(n: int) -> float:
            return (1 + self.expected_accepted(alpha, min(n, budget.max_depth))) / (c.draft_seconds + c.seconds(n))

        best_n = max(range(1, budget.max_nodes + 1), key=rate)
        if self.single_rows == 1 and rate(0) > rate(best_n):
            self._skipped += 1
            if self._skipped % self.explore:
                return 0, 0
        return best_n, min(best_n, budget.max_depth)

    def learn(self, fb: Feedback, verified: Draft) -> None:
        super().learn(fb, verified)
        self.cost.learn(fb)
