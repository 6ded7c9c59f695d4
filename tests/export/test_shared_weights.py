"""A graph saved with its weights referenced inside another saved graph (export.shared_weights):
it runs in onnxruntime and loads in onnx exactly as stored inline, it really reads the source's
bytes, and only byte-identical tensors are shared."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build.export.exporter import save_model
from dejavuu_build.export.shared_weights import MIN_SHARED, save_sharing, tensor_spans


def _graph(w: np.ndarray, b: np.ndarray, extra: np.ndarray | None = None):
    """y = x @ w + b (+ extra): w large (shared), b small (inline), extra only in the second graph."""
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y0"])]
    out = "y0"
    if extra is not None:
        inits.append(numpy_helper.from_array(extra, "extra"))
        nodes.append(helper.make_node("Add", ["y0", "extra"], ["y1"]))
        out = "y1"
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w.shape[0]])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, [1, w.shape[1]])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _run(path, x):
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


@pytest.fixture
def weights():
    rng = np.random.default_rng(0)
    # values that are not fp16 numbers, so fp16_store leaves them fp32 (the shared case of interest)
    w = rng.standard_normal((64, 32)).astype(np.float32) + np.float32(1e-4)
    return w, rng.standard_normal(32).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)


def test_shared_tensors_read_the_source_bytes_and_run_as_inline(tmp_path, weights):
    w, b, other = weights
    save_model(_graph(w, b), tmp_path / "base.onnx")
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    extra = np.random.default_rng(2).standard_normal(32).astype(np.float32)
    save_model(_graph(w, b, extra), tmp_path / "inline.onnx")
    shared = save_sharing(_graph(w, b, extra), tmp_path / "shared.onnx", tmp_path / "base.onnx")

    assert shared == w.nbytes and w.nbytes >= MIN_SHARED  # w only: b is under the threshold
    inline_size, shared_size = (tmp_path / "inline.onnx").stat().st_size, (tmp_path / "shared.onnx").stat().st_size
    assert inline_size - shared_size >= w.nbytes - 200  # w is not stored a second time
    np.testing.assert_array_equal(_run(tmp_path / "shared.onnx", x), _run(tmp_path / "inline.onnx", x))
    loaded = onnx.load(str(tmp_path / "shared.onnx"))  # onnx resolves the reference too
    got = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    np.testing.assert_array_equal(got["w"], w)

    # the reference really reads base.onnx: change w's bytes there and the shared graph follows
    name, off, length = tensor_spans(tmp_path / "base.onnx")["w"]
    assert name == "base.onnx" and length == w.nbytes
    raw = bytearray((tmp_path / "base.onnx").read_bytes())
    raw[off : off + length] = (w * 2).tobytes()
    (tmp_path / "base.onnx").write_bytes(bytes(raw))
    np.testing.assert_allclose(_run(tmp_path / "shared.onnx", x), x @ (w * 2) + b + extra, rtol=1e-5, atol=1e-5)


def test_a_tensor_whose_bytes_differ_stays_inline(tmp_path, weights):
    w, b, other = weights
    save_model(_graph(w, b), tmp_path / "base.onnx")
    shared = save_sharing(_graph(other, b), tmp_path / "other.onnx", tmp_path / "base.onnx")
    assert shared == 0
    m = onnx.load(str(tmp_path / "other.onnx"), load_external_data=False)
    assert all(t.data_location != TensorProto.EXTERNAL for t in m.graph.initializer)
    x = np.ones((1, 64), np.float32)
    np.testing.assert_allclose(_run(tmp_path / "other.onnx", x), x @ other + b, rtol=1e-5, atol=1e-5)


def test_a_source_with_external_data_is_shared_where_its_data_lies(tmp_path, weights):
    w, b, _ = weights
    onnx.save(
        _graph(w, b),
        str(tmp_path / "big.onnx"),
        save_as_external_data=True,
        location="big.onnx.data",
        size_threshold=1024,
    )
    assert tensor_spans(tmp_path / "big.onnx")["w"][0] == "big.onnx.data"
    assert save_sharing(_graph(w, b), tmp_path / "twin.onnx", tmp_path / "big.onnx") == w.nbytes
    x = np.ones((1, 64), np.float32)
    np.testing.assert_array_equal(_run(tmp_path / "twin.onnx", x), _run(tmp_path / "big.onnx", x))


def test_only_a_graph_in_the_same_folder_is_shared(tmp_path, weights):
    w, b, _ = weights
    (tmp_path / "a").mkdir()
    save_model(_graph(w, b), tmp_path / "a" / "base.onnx")
    with pytest.raises(ValueError, match="own folder"):
        save_sharing(_graph(w, b), tmp_path / "twin.onnx", tmp_path / "a" / "base.onnx")
