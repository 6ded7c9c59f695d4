"""fp16_store: fp16-exact fp32 weights saved as fp16 behind a Cast that onnxruntime folds at load,
so the file shrinks and the session's outputs stay bit-identical; readers see the fp32 graph."""

from __future__ import annotations

import collections
import hashlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.export import fp16_store as F
from dejavuu_build.export.exporter import save_model


def _model(rng):
    """x @ A @ B + c: A fp16-exact (8192 values), B not (random fp32), c fp16-exact but small."""
    a = rng.standard_normal((64, 128)).astype(np.float16).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    c = rng.standard_normal(64).astype(np.float16).astype(np.float32)
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "A"], ["h"], name="/a/MatMul"),
            helper.make_node("MatMul", ["h", "B"], ["y"], name="/b/MatMul"),
            helper.make_node("Add", ["y", "c"], ["z"], name="/c/Add"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, 64])],
        [numpy_helper.from_array(v, k) for k, v in (("A", a), ("B", b), ("c", c))],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


def _session(path, optimized=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    if optimized:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def test_fp16_exact_is_bit_exact_and_refuses_subnormals():
    assert F.fp16_exact(np.array([0.0, -0.0, 1.5, -65504.0, 2.0**-14, np.inf], np.float32))
    assert not F.fp16_exact(np.array([0.1], np.float32))  # rounds
    assert not F.fp16_exact(np.array([70000.0], np.float32))  # overflows to inf
    assert not F.fp16_exact(np.array([2.0**-20], np.float32))  # an fp16 subnormal: left fp32
    assert not F.fp16_exact(np.array([2.0**-30], np.float32))  # underflows to 0
    assert not F.fp16_exact(np.array([1.0], np.float64))


def test_pack_shrinks_the_file_keeps_inexact_tensors_and_outputs_are_bit_identical(tmp_path):
    m = _model(np.random.default_rng(0))
    onnx.save(m, str(tmp_path / "plain.onnx"))
    save_model(m, tmp_path / "packed.onnx")  # packs
    packed = onnx.load(str(tmp_path / "packed.onnx"))
    dtypes = {t.name: t.data_type for t in packed.graph.initializer}
    assert dtypes == {"A.fp16": TensorProto.FLOAT16, "B": TensorProto.FLOAT, "c": TensorProto.FLOAT}
    assert [(nd.name, nd.op_type) for nd in packed.graph.node][0] == ("fp16_store/A/Cast", "Cast")
    onnx.checker.check_model(packed)
    plain_size, packed_size = (tmp_path / "plain.onnx").stat().st_size, (tmp_path / "packed.onnx").stat().st_size
    assert plain_size - packed_size >= 64 * 128 * 2 - 200
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    outs = [_session(tmp_path / f, tmp_path / f"opt-{f}").run(None, {"x": x})[0] for f in ("plain.onnx", "packed.onnx")]
    assert outs[0].tobytes() == outs[1].tobytes()
    # onnxruntime folds the Cast at load: the optimized graphs are the same
    ops = [
        collections.Counter(nd.op_type for nd in onnx.load(str(tmp_path / f"opt-{f}")).graph.node)
        for f in ("plain.onnx", "packed.onnx")
    ]
    assert ops[0] == ops[1] and "Cast" not in ops[1]


def test_pack_then_unpack_gives_back_the_same_bytes(tmp_path):
    m = _model(np.random.default_rng(0))
    before = m.SerializeToString()
    assert F.pack(m) == 64 * 128 * 2
    assert F.pack(m) == 0  # already packed: nothing more to do
    assert F.unpack(m) == 1
    assert m.SerializeToString() == before
    save_model(m, tmp_path / "m.onnx")
    assert F.load_unpacked(tmp_path / "m.onnx").SerializeToString() == before
    assert F.unpack(onnx.load(str(tmp_path / "m.onnx"))) == 1


def test_pack_is_deterministic_and_leaves_small_and_input_tensors():
    m1, m2 = _model(np.random.default_rng(0)), _model(np.random.default_rng(0))
    m2.graph.input.append(helper.make_tensor_value_info("A", TensorProto.FLOAT, [64, 128]))  # a default: overridable
    F.pack(m1)
    again = _model(np.random.default_rng(0))
    F.pack(again)
    assert m1.SerializeToString() == again.SerializeToString()
    assert F.pack(m2) == 0
    assert F.pack(_model(np.random.default_rng(0)), min_elements=64) == 64 * 128 * 2 + 64 * 2  # c too


def test_a_gguf_build_stores_its_scales_as_fp16_and_passes_its_gates(cache_dir, tmp_path_factory, monkeypatch):
    """A Q4_1 GGUF's scales and minima are fp16 numbers: its int4 files carry them as fp16 (the tiny
    model's tensors are small, so the size floor is lowered), and every variant still passes its
    gates (row guard, batched = incremental, serving batch): the graph passes read unpacked graphs.
    A second build gives the same bytes."""
    from tiny import tiny_llama_gguf

    from dejavuu_build import schema as S
    from dejavuu_build.build.config import TreeDecoderConfig
    from dejavuu_build.build.pipeline import build_tree_decoder

    monkeypatch.setattr(F, "MIN_ELEMENTS", 64)
    src = tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf")
    folders = [
        build_tree_decoder(
            TreeDecoderConfig(model=str(src), name=f"tiny-gguf-fp16-{k}", variants=(S.FP32, S.INT4), timing=False)
        ).folder
        for k in range(2)
    ]
    m = S.read_manifest(folders[0])
    int4 = sorted(p.name for p in folders[0].glob("decoder_*.onnx") if S.INT4 in p.name)
    assert len(int4) >= 3, int4  # concat, static, rowwise (+ the batched serving graph)
    for name in int4:
        proto = onnx.load(str(folders[0] / name))
        halves = [t for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT16]
        casts = [nd for nd in proto.graph.node if F.packed_source(nd)]
        assert halves and len(casts) == len(halves), name
        assert {F.packed_source(nd) for nd in casts} == {t.name for t in halves}
        assert not F.unpack(F.load_unpacked(folders[0] / name))  # readers see no Cast left
    assert all(rec.passed for v, rec in m.variants.items()), {v: rec.gates for v, rec in m.variants.items()}
    assert m.batched.get("passed"), m.batched
    fp32 = onnx.load(str(folders[0] / S.variant_file(S.FP32)))
    assert not any(F.packed_source(nd) for nd in fp32.graph.node)  # dequantized weights are not fp16 numbers

    def digest(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    for name in int4 + [S.variant_file(S.FP32)]:
        assert digest(folders[0] / name) == digest(folders[1] / name), name
