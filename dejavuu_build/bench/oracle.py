"""The copy-drafting oracle: how far any training-free drafter that copies from the context could go.

At every step of plain decoding's greedy answer, the oracle may draft the longest run of upcoming
tokens found anywhere in the context so far (prompt and answer; ``runs``), with no drafting time;
``plan`` then picks, by dynamic programming over the whole answer, how much of each run to draft so
that the steps' total cost, at this machine's measured cost of a step of R graph rows
(``measure_row_costs``), is least. Its tokens per step and its speedup over plain decoding
(one row per token) bound what copy drafting can take; the bench reports each method's share of
that gain per category.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Mapping, Sequence

from ..runtime.drafters import Draft, DraftBudget, Drafter, Feedback

if TYPE_CHECKING:
    from ..runtime.model import Model

MAX_DRAFT = 7  # drafted tokens per oracle step (8 graph rows): the default chain depth less one
PROBE_TOKENS = 16


def runs(prompt: Sequence[int], answer: Sequence[int], max_draft: int = MAX_DRAFT) -> list[int]:
    """``out[i]``: the longest run ``answer[i : i + m]`` (``m <= max_draft``) that occurs in
    ``prompt + answer[:i]``, for each ``i`` in ``1 .. len(answer) - 1`` (index 0: the prefill's token,
    0). The run starting at ``i`` is what a step at position ``i`` could draft and have accepted
    (its bonus token is ``answer[i + m]``)."""
    # one character per token: str.find is a C substring search
    text = "".join(chr(0x100 + int(t)) for t in (*prompt, *answer))
    p, n = len(prompt), len(answer)
    out = [0] * n
    for i in range(1, n):
        ctx = text[: p + i]
        m = 0
        while m < min(max_draft, n - 1 - i) and ctx.find(text[p + i : p + i + m + 1]) >= 0:
            m += 1
        out[i] = m
    return out


def plan(run_lengths: Sequence[int], cost: Mapping[int, float]) -> tuple[int, float]:
    """(steps, total cost) of the cheapest way to decode the answer whose ``runs`` these are:
    a step at position ``j`` drafts ``n <= run_lengths[j]`` tokens, commits ``n + 1`` and costs
    ``cost[n + 1]`` (graph rows; the largest measured count stands for more)."""
    n = len(run_lengths)
    if n <= 1:
        return 0, 0.0
    top = max(cost)
    best = [float("inf")] * (n + 1)
    steps = [0] * (n + 1)
    best[1] = 0.0  # the first token comes out of prefill
    for j in range(1, n):
        for d in range(run_lengths[j] + 1):
            t = min(n, j + d + 1)
            v = best[j] + cost[min(d + 1, top)]
            if v < best[t]:
                best[t], steps[t] = v, steps[j] + 1
    return steps[n], best[n]


def relative_costs(ms: Mapping[int, float]) -> dict[int, float]:
    """Row costs as multiples of a one-row step (made monotone: more rows never cost less)."""
    base = ms[1]
    out: dict[int, float] = {}
    for r in sorted(ms):
        out[r] = max(ms[r] / base, out.get(r - 1, 1.0))
    return out


class RowProbe(Drafter):
    """A cost probe, not a method: drafts ``k`` of the context's ids every step (rarely accepted) and
    keeps each verify step's drafted count and seconds, so that a step of exactly
    ``k + 1`` graph rows is priced on such steps alone (``seconds``): a request's last ``k`` steps draft
    fewer (its token budget caps each draft), and pricing every step's mean put 8 rows at what about
    6 cost (Gemma-3-270M, AVX2: 25 ms where steps of 8 rows took 31; 2026-12-07)."""

    name = "row_probe"

    def __init__(self, k: int):
        self.k = k
        self.steps: list[tuple[int, float]] = []  # (drafted, verify seconds) per verify step
        self._ids: list[int] = []

    def begin(self, prompt_ids: Sequence[int]) -> None:
        # the prompt's first k + 1 distinct ids, once (k of them differ from any last token)
        self._ids = list(dict.fromkeys(int(x) for x in prompt_ids))[: self.k + 1]

    def propose(self, context: Sequence[int], budget: DraftBudget) -> Draft:
        # the prompt's ids other than the context's last, in order of first sight: a model repeating
        # its last token (tiny random ones do) accepts none of them, and a real one rarely
        last = int(context[-1])
        ids = [t for t in self._ids if t != last] or [last]
        return Draft.chain([ids[i % len(ids)] for i in range(min(self.k, budget.max_nodes, budget.max_depth))])

    def feedback(self, fb: Feedback) -> None:
        if fb.verify_seconds > 0:  # a verify step (prefill's token reports none)
            self.steps.append((fb.drafted, fb.verify_seconds))

    def seconds(self) -> list[float]:
        """Verify seconds of the steps that ran exactly ``k`` drafted tokens."""
        return [t for d, t in self.steps if d == self.k]


def measure_row_costs(model: Model, messages: list[dict] | str, rows: int = 8, rounds: int = 3) -> dict[int, float]:
    """Median over ``rounds`` of the mean seconds of a decode step running exactly R = 1..``rows``
    graph rows (R - 1 drafted tokens, ``RowProbe``) on ``messages``, the row counts interleaved per
    round so that machine load hits all alike."""
    from ..runtime.settings import DecodeSettings

    times: dict[int, list[float]] = {r: [] for r in range(1, rows + 1)}
    fill, model.fill = model.fill, False  # no successor guess in a row of its own: R rows exactly
    try:
        for _ in range(rounds):
            for r in range(1, rows + 1):
                probe = RowProbe(r - 1)
                settings = DecodeSettings(method=probe, max_new_tokens=PROBE_TOKENS + r - 1, max_depth=max(r - 1, 1))
                model.generate(messages, settings)
                if got := probe.seconds():
                    times[r].append(statistics.fmean(got))
    finally:
        model.fill = fill
    return {r: statistics.median(v) for r, v in times.items() if v}
