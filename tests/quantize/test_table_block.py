"""The 8-bit lm-head table's block, measured on the machine that quantizes (``choose_table_block``):
the largest block whose MatMulNBits keeps rows exact here, or the GGUF's own table blocks carried
exactly where they keep rows exact too and run about as fast."""

from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.export.exactness import probe
from dejavuu_build.export.fp16_store import load_unpacked
from dejavuu_build.quantize import nbits
from dejavuu_build.quantize.nbits import PLANS, QuantPlan, choose_table_block, nbits_rows, quantize_model, rows_verdict
from dejavuu_build.schema import EMBED_NODE, INT4, INT8, LM_HEAD_NODE

# the timed carry of the file's own table blocks is off by default (bytes must not follow timing)
TIMED = replace(PLANS[INT4], carry_table=False, table_carry_slowdown=1.10)

K, V = 640, 384  # Gemma-3-270M's hidden size: its 8-bit lm-head in blocks of 128 is row-variant on Intel AMX


def _fake_rows(verdicts: dict[int, str]):
    """nbits_rows as a machine whose blocks have these verdicts would measure them (35 rows)."""
    counts = {"invariant": (35, 35, 35), "guardable": (35, 0, 35), "variant": (35, 3, 32)}
    return lambda bits, block, k, n, acc, threads, zero_points=False: counts[verdicts[block]]


def _fake_slowdown(ratio: float):
    def slowdown(bits, base, other, k, n, acc, threads, **kw):
        ms = {base: {m: 10.0 for m in nbits.TABLE_TIMED_ROWS}, other: {m: 10.0 * ratio for m in nbits.TABLE_TIMED_ROWS}}
        return ms, {m: ratio for m in nbits.TABLE_TIMED_ROWS}

    return slowdown


def test_the_largest_invariant_block_is_taken(monkeypatch):
    monkeypatch.setattr(
        nbits, "nbits_rows", _fake_rows({128: "variant", 64: "invariant", 32: "invariant", 16: "invariant"})
    )
    rec = choose_table_block(K, V, PLANS[INT4])
    assert (rec["block"], rec["verdict"], rec["carried"]) == (64, "invariant", False)
    assert rec["candidates"] == [128, 64, 32, 16] and set(rec["measured"]) == {"128", "64"}  # 32 and 16 not needed
    assert "128: variant" in rec["why"] and "blocks of 64 (re-rounded)" in rec["why"]


def test_the_files_blocks_are_carried_where_invariant_and_fast_enough(monkeypatch):
    monkeypatch.setattr(
        nbits, "nbits_rows", _fake_rows({128: "variant", 64: "invariant", 32: "invariant", 16: "variant"})
    )
    monkeypatch.setattr(nbits, "nbits_slowdown", _fake_slowdown(1.05))
    untimed = replace(PLANS[INT4], carry_table=False)
    assert choose_table_block(K, V, untimed, file_block=32)["carried"] is False
    rec = choose_table_block(K, V, TIMED, file_block=32)
    assert (rec["block"], rec["carried"]) == (32, True) and "the file's own blocks" in rec["why"]
    monkeypatch.setattr(nbits, "nbits_slowdown", _fake_slowdown(1.4))  # too slow: re-rounded at 64
    rec = choose_table_block(K, V, TIMED, file_block=32)
    assert (rec["block"], rec["carried"]) == (64, False) and "1.40x" in rec["why"]
    assert rec["file_block_slowdown"] == {str(m): 1.4 for m in nbits.TABLE_TIMED_ROWS}
    loose = QuantPlan(lm_head_block=128, carry_table=False, table_carry_slowdown=2.0)
    assert choose_table_block(K, V, loose, file_block=32)["carried"]
    # a file block that is itself the largest invariant one is carried without timing
    monkeypatch.setattr(nbits, "nbits_slowdown", None)
    assert choose_table_block(K, V, PLANS[INT8], file_block=32)["carried"]
    # the default plan carries the file's blocks wherever they are as exact as the best, untimed
    monkeypatch.setattr(nbits, "nbits_slowdown", None)
    rec = choose_table_block(K, V, PLANS[INT4], file_block=32)
    assert (rec["block"], rec["carried"]) == (32, True) and "file_block_slowdown" not in rec
    # a file block that is variant here is never carried
    monkeypatch.setattr(
        nbits, "nbits_rows", _fake_rows({128: "variant", 64: "invariant", 32: "variant", 16: "variant"})
    )
    assert choose_table_block(K, V, PLANS[INT4], file_block=32)["block"] == 64


def test_guardable_blocks_come_after_invariant_ones_and_all_variant_is_said(monkeypatch, caplog):
    monkeypatch.setattr(
        nbits, "nbits_rows", _fake_rows({128: "variant", 64: "guardable", 32: "guardable", 16: "invariant"})
    )
    assert choose_table_block(K, V, PLANS[INT4])["block"] == 16
    monkeypatch.setattr(
        nbits, "nbits_rows", _fake_rows({128: "variant", 64: "guardable", 32: "guardable", 16: "variant"})
    )
    rec = choose_table_block(K, V, PLANS[INT4])
    assert (rec["block"], rec["verdict"]) == (64, "guardable")
    monkeypatch.setattr(nbits, "nbits_rows", _fake_rows(dict.fromkeys((128, 64, 32, 16), "variant")))
    rec = choose_table_block(K, V, PLANS[INT4])
    assert rec["verdict"] == "variant" and "no block" in rec["why"] and "no block" in caplog.text


def test_this_machines_choice_is_the_largest_block_that_keeps_rows_exact():
    """Measured for real at Gemma-3-270M's K: the chosen block keeps rows exact here, and every
    larger candidate was measured worse (on Intel AMX, 128 is variant and 64 is taken)."""
    rec = choose_table_block(K, V, PLANS[INT4])
    assert rec["verdict"] in ("invariant", "guardable")
    order = nbits.VERDICTS.index
    for b in rec["candidates"]:
        if b > rec["block"]:
            assert order(rec["measured"][str(b)]["verdict"]) > order(rec["verdict"]), rec
    threads = rec["threads"]
    again = [rows_verdict(*nbits_rows(8, rec["block"], K, V, 4, t)) for t in threads]
    assert max(again, key=order) == rec["verdict"]


@pytest.fixture(scope="module")
def tied_q8(tmp_path_factory):
    """A tied decoder stub (embedding Gather + lm-head MatMul through a Transpose of the same table),
    its table a Q8_0 tensor of a GGUF file de-quantized, as Gemma-3 and SmolLM2 ship theirs."""
    import gguf
    from gguf.quants import dequantize, quantize

    d = tmp_path_factory.mktemp("tied")
    rng = np.random.default_rng(0)
    raw = quantize((rng.standard_normal((V, K)) * 0.05).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w = gguf.GGUFWriter(str(d / "m.gguf"), "gemma3")
    w.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    table = dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(V, K).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["h"], name=EMBED_NODE),
        helper.make_node("Transpose", ["table"], ["table_T"], perm=[1, 0], name="/lm_head/Transpose"),
        helper.make_node("MatMul", ["h", "table_T"], ["logits"], name=LM_HEAD_NODE),
    ]
    g = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, None, V])],
        [numpy_helper.from_array(table, "table")],
    )
    src = d / "fp32.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)]), str(src))
    return d / "m.gguf", src, table


def _table(path) -> tuple[np.ndarray, int]:
    """The quantized table de-quantized, and its block (a carried table's scales are saved as fp16)."""
    m = load_unpacked(path)
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    gbq = next(n for n in m.graph.node if n.op_type == "GatherBlockQuantized")
    block = next(helper.get_attribute_value(a) for a in gbq.attribute if a.name == "block_size")
    q, s = inits[gbq.input[0]].astype(np.float32), inits[gbq.input[2]]
    return ((q.reshape(V, -1, block) - 128) * s[..., None]).reshape(V, K), block


def test_a_tied_q8_0_table_is_the_files_where_chosen(tied_q8, tmp_path, monkeypatch):
    path, src, table = tied_q8
    monkeypatch.setattr(
        nbits, "nbits_rows", _fake_rows({128: "variant", 64: "invariant", 32: "invariant", 16: "invariant"})
    )
    monkeypatch.setattr(nbits, "nbits_slowdown", _fake_slowdown(1.0))
    rep = quantize_model(src, tmp_path / "a.onnx", TIMED, tied=True, gguf=path)
    got, block = _table(tmp_path / "a.onnx")
    assert block == 32 and rep["lm_head_block"]["carried"] and rep["gguf"]["carried"] == 1
    np.testing.assert_array_equal(got, table)  # the file's Q8_0, bit for bit
    assert "token_embd.weight Q8_0 carried exactly" in rep["nodes"][EMBED_NODE]
    assert "one shared table" in rep["nodes"][LM_HEAD_NODE] and "the file's own blocks" in rep["nodes"][LM_HEAD_NODE]
    monkeypatch.setattr(nbits, "nbits_slowdown", _fake_slowdown(1.5))
    rep = quantize_model(src, tmp_path / "b.onnx", TIMED, tied=True, gguf=path)
    got, block = _table(tmp_path / "b.onnx")
    assert block == 64 and not rep["lm_head_block"]["carried"] and rep["gguf"]["requantized"] == 1
    assert "re-rounded" in rep["nodes"][EMBED_NODE] and not np.array_equal(got, table)


def test_the_quantized_lm_head_keeps_rows_exact_on_this_machine(tied_q8, tmp_path):
    """Measured, not mocked: the graph's lm-head (the per-op probe the build runs on it) is not
    row-variant here, and a table the quantizer calls carried is the file's bit for bit."""
    path, src, table = tied_q8
    rep = quantize_model(src, tmp_path / "q.onnx", TIMED, tied=True, gguf=path)
    choice = rep["lm_head_block"]
    got, block = _table(tmp_path / "q.onnx")
    assert block == choice["block"] and choice["file_block"] == 32
    if choice["carried"]:
        np.testing.assert_array_equal(got, table)
    else:  # the file's blocks lost to a larger block that keeps rows exact, and the record says why
        assert block > 32 and ("file_block_slowdown" in choice or choice["measured"]["32"]["verdict"] != "invariant")
    rows = probe(load_unpacked(tmp_path / "q.onnx"))
    head = next(p for p in rows.probes if p.op == "MatMulNBits")
    assert head.signature.startswith(f"MatMulNBits bits=8 block={block} acc=4 K={K} N={V}")
    assert head.verdict == choice["verdict"] != "variant", (head.to_json(), choice)
