"""The runtime on the static, in-place KV flavour: the cache moves only accepted rows, its buffers
are reused, bad drafts are refused. (Every drafter's losslessness on it: test_engine.)"""

import numpy as np
import pytest
from test_engine import PROMPTS

from dejavuu_build.layouts.static import StaticKV
from dejavuu_build.runtime import load


@pytest.fixture(scope="module")
def static(tiny_llama):
    m = load(tiny_llama, variant="int4-static")
    assert m.contract.kv_layout == "static" and m.decoder.static
    return m


def test_trees_accept_more_than_one_path(static):
    """A tree whose accepted path is not the first child: rows of later branches are moved into
    place and the continuation still equals plain decoding."""
    from test_engine import OracleTree

    prompt = PROMPTS[1]
    base = static.generate(prompt, max_new_tokens=30)
    r = static.generate(prompt, method=OracleTree(base.tokens), tree=True, max_new_tokens=30, width=3)
    assert r.tokens == base.tokens and r.stats.steps < base.stats.steps


def test_tree_pad_slots_cost_attention_only(static):
    """The static graph runs a tree's tokens only: its period-aligned pad slots exist in attention
    alone. Each token's logits equal, bit for bit, the same layout run with every slot a row."""
    from dejavuu_build.runtime.tree import aligned_layout, slot_tokens

    dec = static.decoder
    assert dec.sparse
    ids = static.encode(PROMPTS[0])
    kv = dec.new_cache()
    try:
        _, _, pres = dec.forward(ids, None, kv)
        kv.commit(pres, len(ids), list(range(len(ids))))
        parents = [-1, 0, 1, 0, 3, 3]  # root; branch a-b; branch c-(d, e)
        slot, slot_parents = aligned_layout(parents, 8, 32, past=kv.length)
        assert all(s_ >= 0 for s_ in slot) and len(slot_parents) > len(parents)  # pads between branches
        toks = [ids[-1], 11, 12, 13, 14, 15]
        fed = []
        bind = kv.binding.bind_cpu_input
        kv.binding.bind_cpu_input = lambda name, arr: (fed.append((name, arr.shape)), bind(name, arr))
        try:
            sparse = dec.forward(toks, slot_parents, kv, slots=slot)
            dense = dec.forward(slot_tokens(toks, slot, len(slot_parents)), slot_parents, kv)  # a row per slot
        finally:
            kv.binding.bind_cpu_input = bind
        rows = [shape for name, shape in fed if name == "input_ids"]
        assert rows == [(1, len(toks)), (1, len(slot_parents))]
        assert sparse[0].shape == (len(toks), static.contract.vocab_size)
        np.testing.assert_array_equal(sparse[0], dense[0][slot])
        np.testing.assert_array_equal(sparse[1], dense[1][slot])
    finally:
        kv.release()


def test_a_lone_token_is_one_row_bit_equal_to_its_verified_rows(static, tiny_llama):
    """The graph floors GroupQueryAttention at two query rows itself (static_kv._Floor), so the
    build records it length-invariant and the runtime feeds a lone token as ONE graph row; each
    row of 2/3/5/8-row verify steps is bit-equal to the same token decoded alone, at pasts on
    both sides of the key-block edges (without the floor, GQA's one-row kernel gives a lone row
    other bits: 0 of 144 rows equal on SmolLM2 here, docs/exactness.md)."""
    from dejavuu_build.schema import read_manifest

    rec = read_manifest(tiny_llama).variants["int4-static"]
    assert rec.length_invariant, rec.row_guard
    dec = static.decoder
    assert not dec.pad_single and dec.single_rows == 1
    fed = []
    ids = static.encode(PROMPTS[0]) * 6
    for past in (len(ids) // 6, 63, 64, 70):
        toks = ids[past : past + 8]
        kv = dec.new_cache()
        try:
            _, _, pres = dec.forward(ids[:past], None, kv, last=1)
            kv.commit(pres, past, list(range(past)))
            bind = kv.binding.bind_cpu_input

            def spy(name, arr, bind=bind):
                fed.append((name, arr.shape))
                bind(name, arr)

            kv.binding.bind_cpu_input = spy
            lone = []
            for t in toks:
                lg, _, pres = dec.forward([t], None, kv)
                kv.commit(pres, 1, [0])
                lone.append(lg[-1])
            kv.binding.bind_cpu_input = bind
            for r in (2, 3, 5, 8):
                kv.truncate(past)
                lg, _, _ = dec.forward(toks[:r], None, kv)
                for i in range(r):
                    np.testing.assert_array_equal(lg[i], lone[i], err_msg=f"past {past}, row {i} of {r}")
        finally:
            kv.release()
    assert {shape for name, shape in fed if name == "input_ids"} == {(1, 1)}  # one graph row each


def test_a_lone_step_keeps_room_for_the_floor_row(static):
    """The floor writes its extra row one position past the context: a lone step on the last free
    position is refused clearly instead of writing beyond the buffer."""
    from dejavuu_build.errors import GenerationError

    dec = static.decoder
    kv = dec.new_cache()
    try:
        kv.length = kv.capacity - 1
        with pytest.raises(GenerationError, match="KV cache holds"):
            dec.forward([5], None, kv)
    finally:
        kv.release()


def test_commit_moves_only_accepted_rows():
    rng = np.random.default_rng(0)
    buf = rng.standard_normal((4, 1, 2, 32, 8)).astype(np.float32)
    before = buf.copy()
    kv = StaticKV(None, buf, None)
    kv.length = 10
    kv.commit(None, 6, [0, 2, 5])  # a tree path: slots 0, 2, 5 of this step
    assert kv.length == 13
    np.testing.assert_array_equal(buf[:, :, :, :10], before[:, :, :, :10])
    np.testing.assert_array_equal(buf[:, :, :, 10:13], before[:, :, :, [10, 12, 15]])
    kv.commit(None, 4, [0, 1])  # a chain prefix: nothing moves
    assert kv.length == 15
    np.testing.assert_array_equal(buf[:, :, :, 13:], before[:, :, :, 13:])
    kv.truncate(11)
    assert kv.length == 11


def test_buffers_are_reused_and_stats_split_host_time(static):
    r1 = static.generate(PROMPTS[0], method="pld", max_new_tokens=16)
    pool = [id(b) for b in static.decoder.pooled]
    assert pool  # the generation handed its buffer back
    r2 = static.generate(PROMPTS[0], method="pld", max_new_tokens=16)
    assert [id(b) for b in static.decoder.pooled] == pool and r2.tokens == r1.tokens
    st = r2.stats
    assert 0 < st.forward_s <= st.verify_s <= st.total_s and st.host_ms_per_step >= 0


class _BadDrafter:
    """Drafts a fixed (possibly malformed) draft."""

    name = "bad"
    wants_topk = wants_hidden = False

    def __init__(self, tokens, parents):
        self.tokens, self.parents = tokens, parents

    def begin(self, prompt_ids):
        pass

    def propose(self, context, budget):
        from dejavuu_build.runtime.drafters.base import Draft

        return Draft(list(self.tokens), list(self.parents))

    def feedback(self, fb):
        pass

    def end(self):
        pass


@pytest.mark.parametrize(
    "tokens,parents,tree,match",
    [
        ([5, 6, 7], [-1, 2, 0], True, "parents must precede"),  # a forward parent: wrong positions
        ([5, 6, 7], [-1, -1, 0], False, "chain was asked"),  # a tree in chain mode
        ([5, 5], [-1, -1], True, "repeats token"),  # duplicate siblings
    ],
)
def test_malformed_drafts_are_refused_clearly(static, tokens, parents, tree, match):
    """Drafts are validated on every step (not only on request), with one clear error."""
    from dejavuu_build.errors import GenerationError
    from dejavuu_build.runtime.drafters.base import Drafter

    d = type("Bad", (_BadDrafter, Drafter), {})(tokens, parents)
    with pytest.raises(GenerationError, match=match):
        static.generate(PROMPTS[0], method=d, tree=tree, max_new_tokens=8)


def test_over_budget_drafts_are_cut_not_verified_whole():
    from dejavuu_build.runtime.drafters.base import Draft, DraftBudget

    d = Draft([1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, -1, 4], [np.full(3, i) for i in range(6)])
    cut = d.within(DraftBudget(max_nodes=4, max_depth=2, width=2, tree=True))
    assert cut.tokens == [1, 2, 5, 6] and cut.parents == [-1, 0, -1, 2]
    assert [int(p[0]) for p in cut.probs] == [0, 1, 4, 5]
    cut.validate(DraftBudget(max_nodes=4, max_depth=2, width=2, tree=True))


def test_gemma3_sliding_windows_on_the_static_cache_are_lossless_in_tree_mode(cache_dir):
    """Tiny Gemma 3 slides over 8 positions: 40 new tokens after a 40-token prompt run far past
    the window, in the static layout, with trees."""
    from conftest import build_tiny

    m = load(build_tiny("gemma3", cache_dir), variant="int4-static")
    assert m.contract.kv_layout == "static" and any(m.contract.sliding_window)
    prompt = PROMPTS[1]
    base = m.generate(prompt, max_new_tokens=40)
    for method in ("pld", "suffix_decoding", "lookahead"):
        for tree in (False, True):
            r = m.generate(prompt, method=method, tree=tree, max_new_tokens=40)
            assert r.tokens == base.tokens, (method, tree)
