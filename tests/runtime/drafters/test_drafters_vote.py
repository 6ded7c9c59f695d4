"""``suffix_vote``: the continuation most occurrences agree on, cut where its rows stop paying."""

from __future__ import annotations

import numpy as np

from dejavuu_build.bench.replay import Turn, replay_turn
from dejavuu_build.runtime.drafters import DraftBudget, make_drafter


def test_vote_takes_the_continuation_most_occurrences_agree_on():
    # "2 3" is followed by 7 twice and by 8 once (the latest): prompt lookup copies the latest
    ctx = [1, 2, 3, 7, 4, 2, 3, 7, 6, 2, 3, 8, 5, 2, 3]
    one = DraftBudget(max_nodes=1, max_depth=1)
    vote = make_drafter("suffix_vote", sized=False)
    vote.begin(ctx)
    assert vote.propose(ctx, one).tokens == [7]
    pld = make_drafter("pld")
    pld.begin(ctx)
    assert pld.propose(ctx, one).tokens == [8]


def _copying_turn() -> Turn:
    """An answer that copies its prompt except every 4th token, which is new."""
    prompt = np.random.default_rng(0).integers(100, 1000, 120).tolist()
    answer = [t if i % 4 else 5000 + i for i, t in enumerate(prompt)]
    return Turn("1", "qa", 1, prompt, answer, [[t] for t in answer], "max_new_tokens")


def test_vote_drafts_where_rows_are_cheap_and_not_where_they_are_dear():
    t = _copying_turn()
    cheap = {r: 1.0 + 0.05 * (r - 1) for r in range(1, 10)}
    dear = {r: 1.0 + 1.5 * (r - 1) for r in range(1, 10)}  # a drafted token costs more than it can give
    fast = replay_turn(make_drafter("suffix_vote"), t, cheap, fill=False)
    # at best 2 steps per 4 tokens: the 2 copied tokens + the new one as bonus, then the next token
    # plainly (nothing follows a new token anywhere)
    assert (len(t.answer) - 1) / fast.steps > 1.8 and fast.accepted > 0.9 * fast.drafted
    slow = replay_turn(make_drafter("suffix_vote"), t, dear, fill=False)
    assert slow.drafted <= 6, slow  # the first steps, before its row costs are measured
    uncut = replay_turn(make_drafter("suffix_vote", sized=False), t, dear, fill=False)
    assert uncut.drafted > 100 and uncut.cost > 1.5 * slow.cost


def test_vote_cells_tell_matches_inside_this_request_from_the_history():
    """A level's cell holds the longest agreeing match inside this request beside the longest
    anywhere: copies from the live request are accepted far more often than copies from earlier
    requests at the same match length (docs/methods.md, 2026-12-05 issue 34)."""
    vote = make_drafter("suffix_vote", sized=False)
    vote.begin([40, 41, 42, 5, 6, 7, 8, 43])  # an earlier request: "5 6" went on "7 8"
    vote.end()
    budget = DraftBudget(max_nodes=2, max_depth=2)
    # only the history holds "... 5 6": no in-request match (-1) at either level
    ctx = [30, 31, 5, 6]
    vote.begin(ctx)
    assert vote.propose(ctx, budget).tokens == [7, 8]
    cells = vote._pending[-1][2]
    assert [c[1] for c in cells] == [-1, -1] and cells[0][0] < cells[1][0]  # matches of 2, then 3
    vote.end()
    # this request also said "5 6 7 9": its occurrence agrees on 7, then outvotes the history on 9
    ctx = [5, 6, 7, 9, 31, 5, 6]
    vote.begin(ctx)
    assert vote.propose(ctx, budget).tokens == [7, 9]
    cells = vote._pending[-1][2]
    assert [c[1] for c in cells] == [c[0] for c in cells]  # the longest agreeing match is this request's
