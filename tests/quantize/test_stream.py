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
