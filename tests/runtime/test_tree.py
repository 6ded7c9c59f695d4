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
    assert not vis[1, 2] and not vis[2, 1]  # siblings never see each other
    assert vis[4].tolist() == [True, True, False, True, True, False]
    assert vis[5].tolist() == [True, False, True, False, False, True]
    pos, bias = step_inputs(parents, 10)
    assert pos.tolist() == [[10, 11, 11, 12, 13, 12]]
    assert (bias[0, 0, :, :10] == 0).all()  # everyone sees the committed past
    assert bias[0, 0, 5, 10 + 3] < -1e30  # e does not see its cousin c


def test_with_root():
    assert with_root([-1, 0, -1, 2]) == [-1, 0, 1, 0, 3]


def test_aligned_layout_keeps_depth_modulo_period_and_parent_order():
    from dejavuu_build.runtime.tree import aligned_layout

    # root -> a, b ; a -> c, d ; c -> e ; b -> f
    parents = [-1, 0, 0, 1, 1, 3, 2]
    slot, sp = aligned_layout(parents, 4, 64)
    d = depths(parents)
    assert slot[0] == 0 and slot[1] == 1 and slot[3] == 2 and slot[5] == 3  # first-child path: no padding
    for i, s in enumerate(slot):
        assert s % 4 == d[i] % 4
        if parents[i] >= 0:
            assert slot[parents[i]] < s and sp[s] == slot[parents[i]]
    pads = [s for s in range(len(sp)) if s not in slot]
    assert all(sp[s] == -1 for s in pads)
    slot, _ = aligned_layout(parents, 4, 6)  # budget prunes subtrees
    assert slot[4] == -1 and slot[2] == 5 and slot[6] == -1  # d and f pruned, b kept at 1 + 4
    # b's slot (past + 5) would fall in the next 8-key tile while its chain position (past + 1) does not
    slot, _ = aligned_layout(parents, 4, 64, past=6, tile=8)
    assert slot[2] == -1 and slot[1] == 1 and slot[3] == 2


def test_tree_rows_are_bit_identical_to_chains(tiny_llama):
    """The reason for the aligned layout: every node's logits equal its path run as a chain, bit for bit."""
    from dejavuu_build.runtime import load
    from dejavuu_build.runtime.tree import aligned_layout

    m = load(tiny_llama, variant="int4")
    dec, period = m.decoder, m.tree_period
    if period is None:  # then the runtime verifies chains only, and says so
        import pytest

        pytest.skip("this CPU's attention kernel has no exact key-block period")
    tile = m.calibration.tile
    parents = [-1, 0, 0, 1, 2, 4, 0]
    toks = [50, 60, 61, 70, 71, 80, 62]
    for past in (30, 50, 60, 250, 255):  # some right before a key-tile boundary
        kv = dec.new_cache()
        ctx = [10 + i % 200 for i in range(past)]
        _, _, pres = dec.forward(ctx, None, kv)
        kv.commit(pres, len(ctx), list(range(len(ctx))))
        slot, sp = aligned_layout(parents, period, 10 * period, past=past, tile=tile)
        st = [toks[0]] * len(sp)
        for i, s in enumerate(slot):
            if s >= 0:
                st[s] = toks[i]
        out, _, _ = dec.forward(st, sp, kv)
        for i in range(len(toks)):
            if slot[i] < 0:
                continue
            path, j = [], i
            while j >= 0:
                path.append(toks[j])
                j = parents[j]
            chain, _, _ = dec.forward(path[::-1], None, kv)
            assert np.array_equal(out[slot[i]], chain[-1]), (past, i)
