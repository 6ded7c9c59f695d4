"""A sliding window's mask moves into our attention operator only when evaluating the graph's own
mask proves it is that window (export.passes.own_operators._Windows): Gemma 3's exported form is
taken, a mask one position off, with another fill or reading another input is left as it was."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from dejavuu_build import schema as S
from dejavuu_build.export.passes.own_operators import _Windows

W = 8


def mask_model(*, start: int = 0, fill: float = float(np.finfo(np.float32).min), window: int = W, extra=False):
    """``Where(q - k >= window, fill, attention_bias)`` as export.wrapper writes it: k = past
    positions ``start..`` then the step's positions, past = width - slots."""
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)  # noqa: E731
    inits = [
        c("zero", np.int64(0)),
        c("one", np.int64(1)),
        c("start", np.int64(start)),
        c("w", np.int64(window)),
        c("fill", np.float32(fill)),
        c("ax0", np.array([0], np.int64)),
        c("ax1", np.array([1], np.int64)),
        c("ax01", np.array([0, 1], np.int64)),
    ]
    nodes = [
        helper.make_node("Shape", [S.ATTENTION_BIAS], ["width"], start=3, end=4),
        helper.make_node("Shape", [S.POSITION_IDS], ["slots"], start=1, end=2),
        helper.make_node("Sub", ["width", "slots"], ["past1"]),
        helper.make_node("Squeeze", ["past1", "ax0"], ["past"]),
        helper.make_node("Range", ["start", "past", "one"], ["past_pos"]),
        helper.make_node("Gather", [S.POSITION_IDS, "zero"], ["q"], axis=0),
        helper.make_node("Concat", ["past_pos", "q"], ["k"], axis=0),
        helper.make_node("Unsqueeze", ["q", "ax1"], ["q2"]),
        helper.make_node("Unsqueeze", ["k", "ax0"], ["k2"]),
        helper.make_node("Sub", ["q2", "k2"], ["d"]),
        helper.make_node("GreaterOrEqual", ["d", "w"], ["far"]),
        helper.make_node("Unsqueeze", ["far", "ax01"], ["far4"]),
        helper.make_node("Shape", [S.ATTENTION_BIAS], ["bshape"]),
        helper.make_node("Expand", ["fill", "bshape"], ["fills"]),
    ]
    other = "other" if extra else S.ATTENTION_BIAS
    nodes.append(helper.make_node("Where", ["far4", "fills", other], ["windowed"]))
    nodes = [
        helper.make_node(
            n.op_type, n.input, n.output, name=f"/n{i}", **{a.name: helper.get_attribute_value(a) for a in n.attribute}
        )
        for i, n in enumerate(nodes)
    ]
    ins = [
        helper.make_tensor_value_info(S.POSITION_IDS, TensorProto.INT64, [1, "slots"]),
        helper.make_tensor_value_info(S.ATTENTION_BIAS, TensorProto.FLOAT, [1, 1, "slots", "total"]),
    ]
    if extra:
        ins.append(helper.make_tensor_value_info("other", TensorProto.FLOAT, [1, 1, "slots", "total"]))
    out = helper.make_tensor_value_info("windowed", TensorProto.FLOAT, [1, 1, "slots", "total"])
    g = helper.make_graph(nodes, "mask", ins, [out], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def windows_of(model):
    m = ir.from_proto(model)
    g = m.graph
    windowed = g.outputs[0]
    w = _Windows(model, g)
    bias, window = w.of(windowed)
    return bias.name, window, w.found


def test_gemmas_mask_is_proved_and_moved_into_the_operator():
    model = mask_model()
    onnx.checker.check_model(model)
    assert windows_of(model) == (S.ATTENTION_BIAS, W, 1)


@pytest.mark.parametrize(
    "wrong",
    [
        {"start": 1},  # past keys one position off: not the operator's rule
        {"fill": -1e9},  # another fill: other bits for a row that sees only far keys
        {"extra": True},  # the Where keeps another input than attention_bias
    ],
)
def test_a_mask_that_is_not_that_window_stays_as_it_was(wrong):
    assert windows_of(mask_model(**wrong)) == ("windowed", 0, 0)
