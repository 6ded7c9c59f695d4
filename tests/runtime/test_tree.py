"""Tree flattening: positions and masks a wrong implementation would get wrong."""

import numpy as np

from dejavuu_build.runtime.tree import ancestors_mask, causal_inputs, depths, step_inputs, with_root


def test_chain_is_causal():
    pos, bias = causal_inputs(3, 5)
    assert pos.tolist() == [[5, 6, 7]]
    vis = bias[0, 0] == 0
    assert vis[:, :5].all()
    assert (vis[:, 5:] == np.tril(np.ones((3, 3), bool))).all()


def test_siblings_and_deep_branches():
    # root(0) -> a(1), b(2); a -> c(3); c -> d(4); b -> e(5)
    parents = [-1, 0, 0, 1, 3, 2]
    assert depths(parents).tolist() == [0, 1, 1, 2, 3, 2]
    vis = ancestors_mask(parents)
    assert not vis[1, 2] and not vis[2, 1]              # siblings never see each other
    assert vis[4].tolist() == [True, True, False, True, True, False]
    assert vis[5].tolist() == [True, False, True, False, False, True]
    pos, bias = step_inputs(parents, 10)
    assert pos.tolist() == [[10, 11, 11, 12, 13, 12]]
    assert (bias[0, 0, :, :10] == 0).all()              # everyone sees the committed past
    assert bias[0, 0, 5, 10 + 3] < -1e30                # e does not see its cousin c


def test_with_root():
    assert with_root([-1, 0, -1, 2]) == [-1, 0, 1, 0, 3]
