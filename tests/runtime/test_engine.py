"""The engine on tiny random exports: every drafter, chain and tree, greedy and seeded sampling,
reproduces plain decoding token for token; KV handling; tree acceptance; stop conditions."""

import pytest

from dejavuu_build.errors import GenerationError
from dejavuu_build.runtime import load
from dejavuu_build.runtime.drafters import METHODS
from dejavuu_build.runtime.drafters.base import Draft, Drafter
from dejavuu_build.runtime.engine import Engine

PROMPTS = ["abcabcabcabc abcabc", "the cat sat on the mat. the cat sat on the", "1 2 3 1 2 3 1 2 3"]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return load(tiny_llama, variant="int4")


@pytest.fixture(scope="module")
def by_layout(tiny, tiny_llama):
    """The concat-layout int4 and its in-place KV twins."""
    return {
        "int4": tiny,
        "int4-static": load(tiny_llama, variant="int4-static"),
        "int4-rowwise": load(tiny_llama, variant="int4-rowwise"),
    }


@pytest.mark.parametrize("variant", ["int4", "int4-static", "int4-rowwise"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_lossless(by_layout, variant, method):
    m = by_layout[variant]
    trees = variant != "int4-rowwise"  # rowwise verifies chains only (tree requests fall back)
    assert (m.tree_period is not None) == trees
    for prompt in PROMPTS:
        for temp in (0.0, 0.9):
            base = m.generate(prompt, max_new_tokens=40, temperature=temp, seed=11)
            for tree in (False, True):
                r = m.generate(
                    prompt, method=method, tree=tree, max_new_tokens=40, temperature=temp, seed=11, validate_drafts=True
                )
                assert r.tokens == base.tokens, (variant, method, tree, temp, prompt)
                assert r.stats.tokens == len(r.tokens) and r.tree == (tree and trees)


def test_drafting_actually_accepts(tiny):
    r = tiny.generate(PROMPTS[0], method="pld", max_new_tokens=40)
    base = tiny.generate(PROMPTS[0], max_new_tokens=40)
    assert r.tokens == base.tokens
    assert r.stats.steps < base.stats.steps and r.stats.accepted > 0


class OracleTree(Drafter):
    """Drafts a tree whose correct path is NOT the first child, plus wrong siblings at depth 2."""

    name = "oracle"

    def __init__(self, truth):
        self.truth = truth

    def propose(self, context, budget):
        n = len(context) - self.start
        nxt = self.truth[n : n + 3]
        if len(nxt) < 3:
            return Draft()
        w0, w1 = (nxt[0] + 1) % 256, (nxt[1] + 7) % 256
        # node0 wrong, node1 right(depth1) -> node2 wrong, node3 right(depth2) -> node4 right(depth3)
        return Draft([w0, nxt[0], w1, nxt[1], nxt[2]], [-1, -1, 1, 1, 3])

    def begin(self, prompt_ids):
        self.start = len(prompt_ids)


def test_tree_best_path_not_first_child(tiny):
    # A short context: its second-column slots (past + depth + period) stay inside the first
    # 64-key tile, so the layout never has to prune the right branch.
    base = tiny.generate("the cat", max_new_tokens=24)
    d = OracleTree(base.tokens)
    r = tiny.generate("the cat", method=d, tree=True, max_new_tokens=24, max_nodes=8, max_depth=4, width=4)
    assert r.tokens == base.tokens
    # Every full step accepts 3 drafts (+1 bonus): the engine followed the second child.
    assert max(r.stats.accept_hist) == 3 and r.stats.steps <= 8


def test_kv_cache_stays_the_committed_length(tiny, monkeypatch):
    """After every step the cache holds exactly the committed sequence but its last token (the
    one the next forward feeds), and its arrays are exactly that long: chains and trees."""
    from dejavuu_build.layouts.concat import KVCache
    from dejavuu_build.runtime.drafters import make_drafter
    from dejavuu_build.runtime.sampling import Sampler

    commits = []
    real_commit = KVCache.commit

    def commit(self, present, n_new, keep):
        real_commit(self, present, n_new, keep)
        commits.append((self.length, [a.shape[2] for a in self.arrays.values()][0]))

    monkeypatch.setattr(KVCache, "commit", commit)
    ids = tiny.encode(PROMPTS[2])
    for tree in (False, True):
        commits.clear()
        eng = Engine(
            tiny.decoder,
            tree_capable=True,
            period=tiny.tree_period if tree else None,
            tile=tiny.calibration.tile if tree else None,
        )
        committed, checks = [0], []

        def on_tokens(toks, committed=committed, checks=checks):
            committed[0] += len(toks)
            checks.append((commits[-1][0], len(ids) + committed[0] - 1))

        new, st, _ = eng.generate(
            ids,
            drafter=make_drafter("pld"),
            sampler=Sampler(),
            max_new_tokens=30,
            tree=tree,
            eos_ids=[],
            on_tokens=on_tokens,
        )
        assert st.accepted > 0 and len(checks) == st.steps + 1  # drafts were verified, every step seen
        assert all(length == shape for length, shape in commits)
        assert all(have == want for have, want in checks), checks
        assert commits[-1][0] == len(ids) + len(new) - 1


def test_stop_conditions(tiny):
    base = tiny.generate(PROMPTS[0], max_new_tokens=20)
    assert base.stop_reason == "max_new_tokens" and len(base.tokens) == 20
    kw = dict(max_new_tokens=30, temperature=1.0, seed=3)  # seeded sampling: varied text
    sampled = tiny.generate(PROMPTS[0], **kw)
    text = sampled.text
    stop = next((text[k : k + 3] for k in range(3, len(text) - 3) if text.index(text[k : k + 3]) == k), None)
    assert stop is not None, text
    r = tiny.generate(PROMPTS[0], stop=[stop], method="pld", **kw)
    assert r.stop_reason == "stop_string" and r.text == text[: text.index(stop)] != ""
    assert r.tokens == sampled.tokens[: len(r.tokens)] and len(r.tokens) < len(sampled.tokens)
    eos = base.tokens[5]
    tiny.eos_ids = [eos]
    try:
        r = tiny.generate(PROMPTS[0], max_new_tokens=20, method="pld", tree=True)
        assert r.stop_reason == "eos" and r.tokens[-1] == eos and r.tokens == base.tokens[: base.tokens.index(eos) + 1]
    finally:
        tiny.eos_ids = [2]


def test_bad_input(tiny):
    with pytest.raises(GenerationError, match="empty"):
        tiny.generate("   ")
    with pytest.raises(GenerationError, match="positions"):
        tiny.generate("abc", max_new_tokens=10_000)
    with pytest.raises(GenerationError, match="unknown method"):
        tiny.generate("abc", method="nope")


def test_streaming_equals_generate(tiny):
    base = tiny.generate(PROMPTS[1], max_new_tokens=25, method="pld")
    pieces = list(tiny.stream(PROMPTS[1], max_new_tokens=25, method="pld"))
    assert "".join(pieces) == base.text and len(pieces) >= 1


def test_chat_template(tiny):
    ids = tiny.encode([{"role": "user", "content": "hi"}])
    text = tiny.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("assistant\n")


# ---------------------------------------------------------------- item 5: bad generation settings are refused
@pytest.mark.parametrize(
    "kw, what",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"width": 0}, "width"),
        ({"max_depth": 0}, "max_depth"),
        ({"max_nodes": 0}, "max_nodes"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_settings_are_refused(tiny, kw, what):
    with pytest.raises(GenerationError, match=what):
        tiny.generate("abc", max_new_tokens=kw.pop("max_new_tokens", 4), **kw)


def test_a_prompt_that_is_not_utf8_is_refused(tiny):
    with pytest.raises(GenerationError, match="UTF-8"):
        tiny.generate("abc \udcff def", max_new_tokens=4)
    with pytest.raises(GenerationError, match="UTF-8"):
        tiny.generate([{"role": "user", "content": "\udcff"}], max_new_tokens=4)


# ---------------------------------------------------------------- item 14: streaming and stop strings decode incrementally
class _CountingDecode:
    def __init__(self, real):
        self.real, self.ids = real, 0

    def __getattr__(self, k):
        return getattr(self.real, k)

    def decode(self, ids, **kw):
        self.ids += len(ids)
        return self.real.decode(ids, **kw)


@pytest.mark.parametrize("how", ["stream", "stop"])
def test_decoding_cost_is_linear_in_the_tokens(tiny, how):
    counter = _CountingDecode(tiny.tokenizer.tok)
    tiny.tokenizer.tok = counter
    try:
        n = 300
        if how == "stream":
            text = "".join(tiny.stream("abc", max_new_tokens=n))
        else:
            text = tiny.generate("abc", max_new_tokens=n, stop=["\x00never"]).text
    finally:
        tiny.tokenizer.tok = counter.real
    assert text
    assert counter.ids <= 12 * n, f"{how}: decoded {counter.ids} token ids for {n} tokens"


def test_stream_with_stop_strings_equals_generate(tiny):
    kw = dict(max_new_tokens=40, method="pld", temperature=1.0, seed=3)  # seeded sampling: varied text
    text = tiny.generate(PROMPTS[1], **kw).text
    # a stop string whose first occurrence is past the start, so a non-empty prefix streams
    stop = next((text[k : k + 3] for k in range(3, len(text) - 3) if text.index(text[k : k + 3]) == k), None)
    assert stop is not None, text
    r = tiny.generate(PROMPTS[1], stop=[stop, "\x00never"], **kw)
    pieces = list(tiny.stream(PROMPTS[1], stop=[stop, "\x00never"], **kw))
    assert r.stop_reason == "stop_string" and stop not in r.text
    assert "".join(pieces) == r.text == text[: text.index(stop)] != ""


class Silent(Drafter):
    """Never drafts: every step is a lone token, whose pad row the engine fills with a guess."""

    name = "silent"


@pytest.mark.parametrize("temp", [0.0, 0.9])
def test_empty_drafts_fill_the_pad_row_losslessly(by_layout, temp):
    for m in by_layout.values():
        for prompt in PROMPTS:
            base = m.generate(prompt, max_new_tokens=40, temperature=temp, seed=5)
            r = m.generate(prompt, method=Silent(), max_new_tokens=40, temperature=temp, seed=5)
            assert r.tokens == base.tokens
            assert base.stats.filled == 0 and base.stats.steps == 39  # plain decoding stays plain
            assert r.stats.filled > 0  # rowwise: in a row of its own, while it pays (FillPolicy)
            bare = m.generate(prompt, method=Drafter(), max_new_tokens=40, temperature=temp, seed=5)
            assert bare.stats.filled == 0 and bare.stats.steps == 39  # ... also as the bench passes it


def test_fill_policy_fills_while_a_row_pays():
    """Where a guess costs a row: fill iff its acceptance beats the second row's relative cost,
    trying again every ``explore``-th empty step once it does not."""
    from dejavuu_build.runtime.job import FillPolicy

    f = FillPolicy(explore=4)
    assert f.pays(0, 0)  # prior: p = 1/2 against a 1.25x second row
    f.observe(1, 1.0e-2)
    f.observe(2, 1.6e-2)  # a second row costs 60% more
    assert f.pays(8, 6)  # p = 0.7
    assert [f.pays(10, 1) for _ in range(8)] == [False, False, False, True] * 2  # p = 1/6
    f.observe(3, 9.9)  # other row counts do not enter
    assert f.t == {1: 1.0e-2, 2: 1.6e-2}


def test_paid_fills_are_not_the_drafters_cost(by_layout):
    """On rowwise, a filled step's row is the engine's: the drafter hears a lone token's rows and
    no verify time (its cost fit would otherwise learn that drafting nothing costs two rows)."""

    class Recording(Silent):
        def __init__(self):
            self.fbs = []

        def feedback(self, fb):
            self.fbs.append(fb)

    m = by_layout["int4-rowwise"]
    d = Recording()
    r = m.generate(PROMPTS[2], method=d, max_new_tokens=40)
    assert r.stats.fill_accepted > 0
    filled = [fb for fb in d.fbs[1:] if fb.drafted == 0 and len(fb.committed) > 1]  # accepted guesses
    assert len(filled) == r.stats.fill_accepted
    assert all(fb.rows == 1 and fb.verify_seconds == 0.0 for fb in filled)
    assert all(fb.verify_seconds > 0 for fb in d.fbs[1:] if fb.drafted)


def test_fill_guess_takes_the_token_pair_before_the_token():
    """The guess after a context: the successor last seen after its last two tokens, else after its
    last one; a verified row teaches both, under the token before it in its own path."""
    from dejavuu_build.runtime.job import Successors

    s = Successors()
    s.seed([1, 2, 3, 9, 2, 4])  # after 2: 3, then 4; after (1, 2): 3; after (9, 2): 4
    assert s.guess([7, 1, 2]) == 3 and s.guess([7, 9, 2]) == 4  # the pair decides
    assert s.guess([7, 5, 2]) == 4  # an unseen pair: the token's last successor
    assert s.guess([8]) is None and s.guess([]) is None
    # a tree step: root 2 (after 1), nodes 5 (under the root) and 6 (under 5), and 7 (under the root)
    tokens, parents = [2, 5, 6, 7], [-1, 0, 1, 0]
    s.learn(tokens, [8, 11, 12, 13], [1] + [tokens[q] for q in parents[1:]])
    assert s.guess([1, 2]) == 8 and s.guess([2, 5]) == 11 and s.guess([5, 6]) == 12 and s.guess([2, 7]) == 13
    assert s.guess([9, 2]) == 4 and s.guess([0, 2]) == 8  # (9, 2) kept; the token alone: its latest
    s.learn([5], [14], [None])  # no token before: the token's guess only
    assert s.guess([0, 5]) == 14 and s.guess([2, 5]) == 11


def test_filled_guesses_are_accepted(tiny):
    """Greedy on a prompt the tiny model loops on: its own argmax after a token is a good guess."""
    base = tiny.generate(PROMPTS[2], max_new_tokens=40)
    r = tiny.generate(PROMPTS[2], method=Silent(), max_new_tokens=40)
    assert r.tokens == base.tokens
    assert r.stats.fill_accepted > 0 and r.stats.steps == 39 - r.stats.accepted


@pytest.mark.parametrize("variant", ["int4", "int4-static", "int4-rowwise"])
def test_feedback_reports_the_rows_each_step_ran(by_layout, variant):
    """Feedback.rows is what cost-aware sizers fit verify time against: a step with no draft is
    one row on every layout's length-invariant graph (rowwise; the row-guarded concat graph; the
    static one, whose attention floors its rows in the graph); a k-token chain is k+1 rows."""
    single = 1

    class Every3rd(Drafter):
        name = "every3rd"

        def __init__(self):
            self.seen, self.step = [], 0

        def propose(self, context, budget):
            self.step += 1
            return Draft.chain([5, 6, 7][: budget.max_depth]) if self.step % 3 == 0 else Draft()

        def feedback(self, fb):
            self.seen.append((fb.drafted, fb.rows))

    d = Every3rd()
    by_layout[variant].generate(PROMPTS[0], method=d, max_new_tokens=20)
    assert d.seen[0] == (0, 0)  # the prompt's first token: no verify step
    d.seen = d.seen[1:]
    assert {rows for drafted, rows in d.seen if drafted == 0} == {single}
    chains = [(drafted, rows) for drafted, rows in d.seen if drafted]
    assert chains and all(rows == drafted + 1 for drafted, rows in chains), chains
