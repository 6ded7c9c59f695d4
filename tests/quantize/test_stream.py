"""The streamed reader: the graph without its weights, each initializer read alone, as onnx.load has them."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.quantize.stream import StreamedModel


def _model(rng):
    inits = [
        numpy_helper.from_array(rng.standard_normal((64, 48)).astype(np.float32), "W"),
        numpy_helper.from_array(np.arange(7, dtype=np.int64), "idx"),
        numpy_helper.from_array(np.float32(2.5), "scalar"),
        numpy_helper.from_array(rng.standard_normal((3, 4, 5)).astype(np.float32), "cube"),
    ]
    g = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["y"], name="/m/MatMul"),
            helper.make_node("Mul", ["y", "scalar"], ["z"], name="/m/Mul"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, 64])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        inits,
        doc_string="kept",
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], producer_name="t")
    helper.set_model_props(m, {"k": "v"})
    return m


@pytest.mark.parametrize("external", [False, True])
def test_streamed_model_is_the_loaded_model(tmp_path, external):
    m = _model(np.random.default_rng(0))
    arrays = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}  # saving external data moves them
    path = tmp_path / "m.onnx"
    if external:
        onnx.save(
            m,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="m.onnx.data",
            size_threshold=64,
        )
    else:
        onnx.save(m, str(path))
    s = StreamedModel(path)
    loaded = onnx.load(str(path))
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(loaded)
    del skeleton.graph.initializer[:]
    assert s.model.SerializeToString() == skeleton.SerializeToString()
    assert s.names == [t.name for t in m.graph.initializer]
    for t in m.graph.initializer:
        assert s.dims(t.name) == tuple(t.dims)
        a = s.array(t.name)
        np.testing.assert_array_equal(a, arrays[t.name])
        assert a.dtype == arrays[t.name].dtype and not onnx.external_data_helper.uses_external_data(s.proto(t.name))
    assert "W" in s and "nope" not in s
    s.close()


def test_a_packed_file_streams_as_the_graph_before_packing(tmp_path):
    """A weight stored as fp16 behind a Cast (export.fp16_store.pack) reads as the fp32 one, its Cast
    gone, in the file's order: the quantizer sees the graph that was packed."""
    from dejavuu_build.export import fp16_store

    m = _model(np.random.default_rng(0))
    w = numpy_helper.to_array(m.graph.initializer[0]).astype(np.float16).astype(np.float32)
    m.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "W"))
    before = onnx.ModelProto()
    before.CopyFrom(m)
    assert fp16_store.pack(m, min_elements=16) == w.nbytes // 2
    onnx.save(m, str(tmp_path / "m.onnx"))
    s = StreamedModel(tmp_path / "m.onnx")
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(before)
    del skeleton.graph.initializer[:]
    assert s.model.SerializeToString() == skeleton.SerializeToString()
    assert s.names == [t.name for t in before.graph.initializer]
    assert "W" in s and "W.fp16" not in s and s.dims("W") == (64, 48)
    assert [s.proto(t.name).SerializeToString() for t in before.graph.initializer] == [
        t.SerializeToString() for t in before.graph.initializer
    ]
    s.close()


def test_quantizing_a_packed_fp32_export_gives_the_same_file(tiny_llama, tmp_path):
    """An fp32 export whose weights are fp16 numbers (an fp16 checkpoint's) is saved packed: the
    quantizer reads it through the stream and writes the same bytes as from the unpacked file."""
    from dejavuu_build import precisions as P
    from dejavuu_build import schema as S
    from dejavuu_build.export.exporter import save_model
    from dejavuu_build.export.passes.row_guard import strip_row_guard
    from dejavuu_build.quantize import quantize_model

    m = strip_row_guard(onnx.load(str(tiny_llama / S.variant_file(S.FP32))))
    for t in m.graph.initializer:
        if t.data_type == TensorProto.FLOAT and len(t.dims) == 2:
            a = numpy_helper.to_array(t).astype(np.float16).astype(np.float32)
            a[np.abs(a) < 2.0**-14] = 0.0  # no fp16 subnormals: every matrix is fp16-exact
            t.CopyFrom(numpy_helper.from_array(a, t.name))
    onnx.save(m, str(tmp_path / "plain.onnx"))
    save_model(m, tmp_path / "packed.onnx")
    assert (tmp_path / "packed.onnx").stat().st_size < 0.7 * (tmp_path / "plain.onnx").stat().st_size
    plan = P.plan(S.INT4)
    quantize_model(tmp_path / "plain.onnx", tmp_path / "a.onnx", plan, tied=True)
    quantize_model(tmp_path / "packed.onnx", tmp_path / "b.onnx", plan, tied=True)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
