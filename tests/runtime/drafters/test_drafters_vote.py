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
