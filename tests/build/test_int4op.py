"""`int4op` end to end on a tiny Llama GGUF (Q4_1 blocks): its body runs our own operator
(kernels.q41) on the file's blocks, it passes every gate, every drafter reproduces plain decoding
on it token for token (chains and trees), only our runtime is pointed at it, and a machine where
the operator cannot be built says so in one line instead of building it."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from parity import assert_lossless

from dejavuu_build import schema as S
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build.pipeline import build_tree_decoder
from dejavuu_build.errors import KernelUnavailable
from dejavuu_build.kernels import attn, q41
from dejavuu_build.runtime import load
from dejavuu_build.runtime.drafters import METHODS
from dejavuu_build.runtime.session import graph_domains

pytestmark = pytest.mark.slow  # a build (~1 min on 2 cores)

PROMPTS = ["hello hello hello world", "abcabcabcabc abcabc", "the cat the cat the cat"]


@pytest.fixture(scope="module")
def entry(cache_dir, tmp_path_factory):
    from tiny import tiny_llama_gguf

    # heads of 64: the static flavour runs our attention operator too (kernels.attn)
    src = tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", head_size=64)
    cfg = TreeDecoderConfig(
        model=str(src),
        name="tiny-int4op",
        variants=("fp32", "int4op"),
        timing=False,
        reference_tokens=12,
        kv_layouts=(S.KV_CONCAT, S.KV_STATIC),
    )
    return build_tree_decoder(cfg)


def test_the_body_is_the_files_blocks_in_our_operator_and_passes_every_gate(entry):
    m = entry.manifest
    assert sorted(m.variants, key=S.variant_order) == ["fp32", "fp32-static", "int4op", "int4op-static"]
    for v in ("int4op", "int4op-static"):
        rec = m.variants[v]
        assert rec.passed, (v, rec.gates)
        batched = rec.gates["batched_vs_incremental"]
        assert batched["mismatches"] == 0 and batched["logits_maxdiff"] == 0.0
        assert rec.quant["operators"] == [q41.DOMAIN]
    body = {k: n for k, n in m.variants["int4op"].quant["nodes"].items() if "/layers." in k}
    assert len(body) == 2 * 7 and all(n.endswith("Q4_1 carried exactly (q41 operator)") for n in body.values()), body
    # the static flavour's attention is ours (no GroupQueryAttention, no row floor)
    static = entry.folder / m.variants["int4op-static"].file
    assert graph_domains(static) >= {q41.DOMAIN, attn.DOMAIN}
    ops = Counter(n.op_type for n in onnx.load(static, load_external_data=False).graph.node)
    assert ops["GroupAttention"] == 2 and ops["SwiGLU"] == 2, ops
    assert not {"GroupQueryAttention", "Pad", "Split", "Sigmoid"} & set(ops), ops  # no floor, no unfused MLP
    assert graph_domains(entry.folder / m.variants["fp32-static"].file) & {attn.DOMAIN} == set()
    # and the server batches it: the operator takes the batch itself (no gathers around it), gated
    # bit-identical to each request alone
    assert m.batched["variant"] == "int4op-static" and m.batched["passed"], m.batched
    assert m.batched["gate"]["mismatches"] == 0 and m.batched["gate"]["steps_checked"] > 0
    batched = onnx.load(entry.folder / m.batched["file"], load_external_data=False).graph
    ops = Counter(n.op_type for n in batched.node)
    assert ops["GroupAttention"] == 2 and "GroupQueryAttention" not in ops and ops["Gather"] <= 1, ops
    assert all(len(n.input) == 11 and n.input[9] == S.SEQLENS_K for n in batched.node if n.op_type == "GroupAttention")
    # only runtimes that build our operator are pointed at it: the `dejavuu` package's view lists fp32
    assert list(S.manifest_provenance(m)["variants"]) == ["fp32"]
    assert not S.portable("int4op-static") and S.portable("int4-static")


@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_lossless_on_the_operator(entry, method):
    m = load(entry.folder, variant="int4op-static")
    assert_lossless(m, method, PROMPTS)


def test_a_machine_without_the_operator_refuses_it_in_one_line(entry, monkeypatch):
    """No compiler: the explicit precision is refused with what to do (exit 2, one line), the
    auto build's trial and quant-only's default skip it, and loading its graph says why."""
    from test_trust_cli import invoke, one_line_error

    from dejavuu_build import kernels
    from dejavuu_build.build import pipeline

    why = "no C++ compiler found: install g++ (or set CXX)"
    monkeypatch.setattr(kernels, "unavailable", lambda ops: why)
    r = invoke("quant-only", "--name", "tiny-int4op", "--variants", "int4op", "--no-timing")
    one_line_error(r, "runs our own operator, which this machine cannot: no C++ compiler found")
    assert pipeline._unrunnable("int4op") and not pipeline._unrunnable("int4")

    def refuse(so):
        raise KernelUnavailable(why)

    monkeypatch.setitem(kernels.OPERATORS, q41.DOMAIN, refuse)
    with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
        load(entry.folder, variant="int4op-static")
    assert load(entry.folder, variant="fp32").variant == "fp32"  # a graph without it never asks for it


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_requests_on_the_operator_equal_each_alone(entry, temperature):
    """Requests side by side in the operator's batched graph (every method, chains and trees,
    different prompt lengths) get the tokens each gets alone."""
    from scheduling import assert_batched_equal_alone

    assert_batched_equal_alone(load(entry.folder), PROMPTS, temperature)


def test_the_server_serves_the_operator_default_with_generates_answer(entry, tmp_path):
    """One model, one answer where the default runs our attention operator: the server batches it
    and concurrent clients of a real HTTP server get the tokens `generate` gives."""
    openai = pytest.importorskip("openai")
    import re
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from dejavuu_build.serve.bench import start_server

    def shared_forwards() -> float:
        found = re.search(r"^dejavuu_shared_forwards(?:_total)?\s+(\S+)$", httpx.get(url + "/metrics").text, re.M)
        assert found
        return float(found.group(1))

    model = load(entry.folder)
    assert model.variant == entry.manifest.default_variant == "int4op-static"
    proc, url = start_server("tiny-int4op", "--method", "pld", log_path=str(tmp_path / "server.log"))
    try:
        assert httpx.get(url + "/health").json()["batched"] is True
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        texts = [p * k for k in (1, 2) for p in PROMPTS]

        def ask(text):
            return client.completions.create(model="tiny-int4op", prompt=text, max_tokens=16, temperature=0.0)

        before = shared_forwards()
        with ThreadPoolExecutor(len(texts)) as pool:
            got = list(pool.map(ask, texts))
        for text, g in zip(texts, got):
            ref = model.generate(text, max_new_tokens=16, method="baseline", temperature=0.0)
            assert g.choices[0].text == ref.text, text
        assert shared_forwards() > before  # really side by side
    finally:
        proc.terminate()
        proc.wait(30)
