"""The step machine's two pure steps (runtime.job): which draft nodes a verify accepts, and where a
step's tokens are cut (EOS, the token budget, a stop string). No graph: logits are made by hand."""

import numpy as np

from dejavuu_build.runtime.drafters.base import Draft
from dejavuu_build.runtime.job import accept_path, cut_step
from dejavuu_build.runtime.sampling import Sampler, residual

V = 10


def _logits(argmax: list[int]) -> np.ndarray:
    out = np.zeros((len(argmax), V), np.float32)
    out[np.arange(len(argmax)), argmax] = 5.0
    return out


def test_accept_path_follows_the_branch_the_target_picks():
    # step nodes: 0 root, 1 = 4 and 2 = 5 its children, 3 = 6 under node 2
    step_tokens, parents = [9, 4, 5, 6], [-1, 0, 0, 2]
    draft = Draft([4, 5, 6], [-1, -1, 1])
    # the target picks 5 after the root, 6 after node 2 and 7 after node 3: node 1 is rejected
    committed, path = accept_path(step_tokens, parents, draft, _logits([5, 0, 6, 7]), Sampler(), 20, residual)
    assert path == [0, 2, 3] and committed == [5, 6, 7]


def test_accept_path_stops_at_the_first_disagreement():
    committed, path = accept_path(
        [9, 4, 5], [-1, 0, 1], Draft.chain([4, 5]), _logits([3, 5, 1]), Sampler(), 0, residual
    )
    assert path == [0] and committed == [3]  # the target's own token, no draft node


def test_accept_path_uses_a_given_argmax_over_the_logits():
    committed, path = accept_path(
        [9, 4], [-1, 0], Draft.chain([4]), _logits([1, 2]), Sampler(), 0, residual, argmax=np.array([4, 8])
    )
    assert path == [0, 1] and committed == [4, 8]


def test_cut_step_reasons():
    assert cut_step([1, 2], [3, 4], set(), 10, None) == ([3, 4], None)
    assert cut_step([1, 2], [3, 0, 4], {0}, 10, None) == ([3, 0], "eos")
    assert cut_step([1, 2], [3, 4, 5], set(), 4, None) == ([3, 4], "max_new_tokens")

    # a stop string ending with generated token 4 (prefix length 4 of [1, 2, 3, 4, 5])
    def stop(ids):
        return 4 if len(ids) >= 4 else None

    assert cut_step([1, 2], [3, 4, 5], set(), 10, stop) == ([3, 4], "stop_string")
    # a stop string already inside earlier tokens keeps none of this step's
    assert cut_step([1, 2], [3], set(), 10, lambda ids: 1) == ([], "stop_string")
