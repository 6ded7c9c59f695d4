"""``sizing.RowCosts``: verify seconds by graph rows, the one cost model of every sizing drafter."""

from __future__ import annotations

import pytest

from dejavuu_build.runtime.drafters import Feedback
from dejavuu_build.runtime.drafters.sizing import PRIOR_ROW_COSTS, RowCosts

# a CPU's shape (docs/methods.md's replay costs): the fifth row nearly free, the seventh dear
TRUE = {1: 10.0, 2: 12.3, 3: 13.9, 4: 15.1, 5: 15.3, 6: 17.3, 7: 22.5, 8: 22.5}


def fed(counts: dict[int, int], costs: dict[int, float] = TRUE, **kwargs) -> RowCosts:
    c = RowCosts(**kwargs)
    for rows, n in counts.items():
        for _ in range(n):
            c.learn(Feedback(committed=[1], drafted=rows - 1, accepted=0, verify_seconds=costs[rows], rows=rows))
    return c


def test_before_any_timing_costs_are_the_prior_and_a_lone_token_is_two_rows():
    c = RowCosts()
    assert not c.ready and c.single_rows == 2
    assert [c.cost(r) for r in (1, 2, 9)] == [PRIOR_ROW_COSTS[0], PRIOR_ROW_COSTS[1], PRIOR_ROW_COSTS[8]]
    assert c.cost(12) > c.cost(9)  # past the prior: its last step, continued
    assert c.seconds(0) == c.cost(2)  # padded decoder: a lone token still runs 2 rows


def test_a_step_with_no_draft_teaches_a_rowwise_decoder_s_single_row():
    c = RowCosts()
    c.learn(Feedback(committed=[1], drafted=0, accepted=0, verify_seconds=0.01, rows=1))
    assert c.single_rows == 1 and c.rows(0) == 1 and c.rows(3) == 4


def test_counts_drafted_often_are_priced_as_measured_even_where_rows_are_not_linear():
    c = fed({r: 30 for r in TRUE})
    for r, t in TRUE.items():
        assert c.cost(r) == pytest.approx(t, rel=0.02), r
    # a straight line through the same timings would price the fifth row at ~+1.7, not +0.2
    assert c.cost(5) - c.cost(4) < 0.5


def test_unseen_counts_come_from_the_line_through_every_timing_and_never_fall():
    c = fed({1: 20, 2: 20, 5: 20})
    assert c.ready
    line = {r: c.cost(r) for r in range(1, 10)}
    assert line[1] == pytest.approx(10.0, rel=0.02) and line[5] == pytest.approx(15.3, rel=0.02)
    assert line[1] < line[2] < line[3] <= line[4] <= line[5] <= line[6] < line[9]
    # 3 and 4 rows were never timed: between the measured 2 and 5 rows
    assert 12.3 <= line[3] <= 15.3 and 12.3 <= line[4] <= 15.3


def test_one_count_timed_scales_the_prior():
    c = fed({1: 5})
    assert c.cost(1) == pytest.approx(10.0)
    assert c.cost(4) == pytest.approx(10.0 * PRIOR_ROW_COSTS[3] / PRIOR_ROW_COSTS[0])


def test_a_few_timings_lean_on_the_line_and_a_slower_machine_is_followed():
    noisy = fed({1: 10, 2: 10, 3: 10, 4: 10})
    noisy.observe(6, 40.0)  # one outlier at 6 rows: shrunk toward the line, not taken whole
    assert 17.0 < noisy.cost(6) < 40.0
    slow = fed({1: 20, 2: 20}, shrink=0.0)
    for _ in range(60):  # the machine slows down 2x: the forgetful means follow
        slow.observe(1, 20.0)
        slow.observe(2, 24.6)
    assert slow.cost(1) == pytest.approx(20.0, rel=0.05) and slow.cost(2) == pytest.approx(24.6, rel=0.05)


def test_steps_without_timing_teach_nothing():
    c = RowCosts()
    c.learn(Feedback(committed=[1], drafted=0, accepted=0, verify_seconds=0.0, rows=1))  # an engine-filled step
    assert not c.ready and c.cost(1) == PRIOR_ROW_COSTS[0] and c.single_rows == 1
