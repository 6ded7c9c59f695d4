"""The key floor (export/passes/key_floor.py): attention at head size 256 gives a row the same bits
whatever the step's row count, also where a step's keys cross 64 (onnxruntime's SGEMM reduces a
head of 256 in one pass over at most 64 keys, in two passes of 128 above: docs/exactness.md).

Hand-built one-layer graphs with Gemma-3-270M's attention shapes (4 query heads over 1 key/value
head of 256): the concat flavour's ONNX Attention with its floor, and the static flavour's
GroupQueryAttention as export.passes.static_kv makes it, each run the way the runtime runs a step
(past + rows, causal), compared bit for bit across row counts at every position around 64."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from dejavuu_build import schema as S
from dejavuu_build.export import exactness as E
from dejavuu_build.export.passes.key_floor import KEY_FLOOR, NEG, floor_keys, needs_key_floor
from dejavuu_build.export.passes.row_guard import guard_rows, strip_row_guard
from dejavuu_build.export.passes.static_kv import to_static_kv

HEADS, KV, D = 4, 1, 256
Q = S.INPUTS_EMBEDS  # the queries stand in for the graph's primary input (the row guard counts rows on it)


def _concat_layer(head_dim: int = D):
    """One concat-flavour attention layer as our exporter shapes it: q/k/v [1, S, heads*D] reshaped
    and transposed, K/V = Concat(past, new), ONNX Attention with the caller's additive bias."""
    f = TensorProto.FLOAT
    ins = [
        helper.make_tensor_value_info(Q, f, [1, "S", HEADS * head_dim]),
        helper.make_tensor_value_info("k", f, [1, "S", KV * head_dim]),
        helper.make_tensor_value_info("v", f, [1, "S", KV * head_dim]),
        helper.make_tensor_value_info(S.ATTENTION_BIAS, f, [1, 1, "S", "T"]),
        helper.make_tensor_value_info(S.POSITION_IDS, TensorProto.INT64, [1, "S"]),
        helper.make_tensor_value_info("past_key_values.0.key", f, [1, KV, "P", head_dim]),
        helper.make_tensor_value_info("past_key_values.0.value", f, [1, KV, "P", head_dim]),
    ]
    shp = {
        "q": helper.make_tensor("shape_q", TensorProto.INT64, [4], [0, 0, HEADS, head_dim]),
        "kv": helper.make_tensor("shape_kv", TensorProto.INT64, [4], [0, 0, KV, head_dim]),
        "out": helper.make_tensor("shape_out", TensorProto.INT64, [3], [0, 0, -1]),
    }
    nodes = []
    for x, s in (("q", "shape_q"), ("k", "shape_kv"), ("v", "shape_kv")):
        nodes += [
            helper.make_node("Reshape", [Q if x == "q" else x, s], [f"{x}_r"], name=f"/l0/attn/{x}_Reshape"),
            helper.make_node("Transpose", [f"{x}_r"], [f"{x}4"], name=f"/l0/attn/{x}_Transpose", perm=[0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("Concat", ["past_key_values.0.key", "k4"], ["present.0.key"], name="/l0/attn/cat_k", axis=2),
        helper.make_node(
            "Concat", ["past_key_values.0.value", "v4"], ["present.0.value"], name="/l0/attn/cat_v", axis=2
        ),
        helper.make_node(
            "Attention", ["q4", "present.0.key", "present.0.value", S.ATTENTION_BIAS], ["y4"], name="/l0/attn/Attention"
        ),
        helper.make_node("Transpose", ["y4"], ["y_t"], name="/l0/attn/y_Transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["y_t", "shape_out"], ["y3"], name="/l0/attn/y_Reshape"),
        helper.make_node("Identity", ["y3"], ["y"], name="/l0/o_proj"),  # what the output projection reads
    ]
    outs = [
        helper.make_tensor_value_info("y", f, [1, "S", HEADS * head_dim]),
        helper.make_tensor_value_info("present.0.key", f, [1, KV, "T", head_dim]),
        helper.make_tensor_value_info("present.0.value", f, [1, KV, "T", head_dim]),
    ]
    g = helper.make_graph(nodes, "layer", ins, outs, list(shp.values()))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = S.DEFAULT_THREADS
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


class _Steps:
    """Runs a step (past P, rows S) of the one-layer graph as the runtime does, over fixed random
    q/k/v per position; returns the attention output of each row [S, heads*D]."""

    def __init__(self, model, n: int = 100, head_dim: int = D):
        rng = np.random.default_rng(0)
        self.q = rng.standard_normal((1, n, HEADS * head_dim)).astype(np.float32)
        self.k = rng.standard_normal((1, n, KV * head_dim)).astype(np.float32)
        self.v = rng.standard_normal((1, n, KV * head_dim)).astype(np.float32)
        self.s, self.d = _session(model), head_dim
        self.names = {i.name for i in self.s.get_inputs()}
        past = next(i for i in self.s.get_inputs() if i.name == "past_key_values.0.key")
        self.capacity = past.shape[2] if isinstance(past.shape[2], int) else 0

    def __call__(self, P: int, rows: int) -> np.ndarray:
        sl = slice(P, P + rows)
        later = np.zeros((rows, P + rows), bool)
        later[:, P:] = np.triu(np.ones((rows, rows), bool), 1)  # causal: a row sees the past and itself
        bias = np.where(later, NEG, np.float32(0))[None, None]
        kv = {}
        for name, x in (("key", self.k), ("value", self.v)):
            past = x[:, :P].reshape(1, P, KV, self.d).transpose(0, 2, 1, 3)
            if self.capacity:  # the static flavour's buffer: the past, then zeros
                buf = np.zeros((1, KV, self.capacity, self.d), np.float32)
                buf[:, :, :P] = past
                past = buf
            kv[f"past_key_values.0.{name}"] = past
        feeds = {
            Q: self.q[:, sl],
            "k": self.k[:, sl],
            "v": self.v[:, sl],
            S.ATTENTION_BIAS: bias,
            S.POSITION_IDS: np.arange(P, P + rows, dtype=np.int64)[None],
            **kv,
        }
        for name in (S.SLOT_ROWS, S.ROW_SLOTS):
            if name in self.names:
                feeds[name] = np.arange(rows, dtype=np.int64)
        return self.s.run(["y"], {k: v for k, v in feeds.items() if k in self.names})[0][0]


def _row_variants(steps, positions, rows=(2, 3, 5, 8, 17)) -> list[tuple[int, int, int, float]]:
    """(position, past, rows, max diff) of every step whose output for the row at ``position``
    differs from that row in a two-row step (the row and the next: a lone token as the runtime
    pads it, or a 1-node draft)."""
    bad = []
    for p in positions:
        ref = steps(p, 2)[0]
        for n in rows:
            for first in sorted({p, max(0, p - n // 2), max(0, p - n + 1)}):  # the row first, mid, last
                if first + n <= p:
                    continue
                out = steps(first, n)[p - first]
                d = float(np.abs(out - ref).max())
                if d != 0.0:
                    bad.append((p, first, n, d))
    return bad


AROUND_64 = range(44, 72)  # rows whose steps' key counts fall on both sides of 64


def test_floor_is_for_head_sizes_above_128():
    assert not needs_key_floor(64) and not needs_key_floor(128) and needs_key_floor(256)
    m = _concat_layer(64)
    before = m.SerializeToString()
    assert floor_keys(m, 64).SerializeToString() == before  # SmolLM2's head size: the graph is untouched


def test_concat_attention_with_the_floor_is_row_exact_around_64_keys():
    m = floor_keys(_concat_layer(), D)
    assert sum("/row_guard/key_floor/" in n.name for n in m.graph.node) == 7
    assert _row_variants(_Steps(m), AROUND_64) == []


def test_static_gqa_with_the_floor_is_row_exact_around_64_keys():
    m = to_static_kv(_concat_layer(), 128, fuse=False)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("GroupQueryAttention") == 1 and "Attention" not in ops
    assert any("/kv_static/key_floor/" in n.name for n in m.graph.node)
    assert _row_variants(_Steps(m), AROUND_64) == []


def test_static_gqa_floor_keeps_the_buffer_and_the_function():
    """The extra rows never show: the buffer holds the past and the step's rows where the concat
    graph's present has them, and the rows' outputs match the concat graph's (float tolerance: GQA
    and Attention are other kernels)."""
    concat, static = _Steps(_concat_layer()), _Steps(to_static_kv(_concat_layer(), 128, fuse=False))
    for P, rows in ((0, 5), (3, 2), (40, 8), (70, 3)):
        np.testing.assert_allclose(static(P, rows), concat(P, rows), atol=2e-5)


def test_static_buffer_past_the_step_is_untouched_beyond_the_floor():
    """In place (one buffer bound as past and present, as the runtime binds it): a step over past
    70 (above the floor) writes its rows only; a step at past 3 writes the floor's extra rows (copies
    of its first row's K) up to position KEY_FLOOR - 1 at most (beyond the context: ignored, then
    overwritten), never beyond."""
    import onnxruntime as ort

    st = _Steps(to_static_kv(_concat_layer(), 128, fuse=False))
    assert S.SLOT_ROWS in st.names  # sparse: the floor is folded into the slot index
    for P, rows, last in ((3, 2, KEY_FLOOR), (70, 3, 73)):
        b = st.s.io_binding()
        bufs = {}
        for name in ("key", "value"):
            bufs[name] = ort.OrtValue.ortvalue_from_numpy(np.full((1, KV, 128, D), 7.0, np.float32))
            b.bind_ortvalue_input(f"past_key_values.0.{name}", bufs[name])
            b.bind_ortvalue_output(f"present.0.{name}", bufs[name])
        feeds = {
            Q: st.q[:, P : P + rows],
            "k": st.k[:, P : P + rows],
            "v": st.v[:, P : P + rows],
            S.ATTENTION_BIAS: np.zeros((1, 1, rows, P + rows), np.float32),
            S.POSITION_IDS: np.arange(P, P + rows, dtype=np.int64)[None],
            S.SLOT_ROWS: np.arange(rows, dtype=np.int64),
            S.ROW_SLOTS: np.arange(rows, dtype=np.int64),
        }
        for k, v in feeds.items():
            if k in st.names:
                b.bind_cpu_input(k, v)
        b.bind_output("y")
        st.s.run_with_iobinding(b)
        key = bufs["key"].numpy()
        np.testing.assert_array_equal(key[0, 0, P : P + rows], st.k[0, P : P + rows])
        assert (key[0, 0, :P] == 7.0).all() and (key[0, 0, last:] == 7.0).all()
        # the floor's rows read the step's first row (a sparse graph pads slot_rows with row 0)
        assert (key[0, 0, P + rows : last] == st.k[0, P]).all()


def test_strip_row_guard_removes_the_floor_with_the_guard():
    plain = _concat_layer()
    m = floor_keys(_concat_layer(), D)
    guard_rows(m, ["/l0/attn/Attention"], length_invariant=True)  # the guard pads the floored mask's rows
    back = strip_row_guard(m)
    assert [(n.name, list(n.input), list(n.output)) for n in back.graph.node] == [
        (n.name, list(n.input), list(n.output)) for n in plain.graph.node
    ]
    assert {t.name for t in back.graph.initializer} == {t.name for t in plain.graph.initializer}


@pytest.mark.parametrize("past", [56, 60])
def test_probe_measures_attention_with_its_floor(past):
    """The build's per-op probe feeds the node's unfloored inputs, so it measures the floor: a row
    beside a pad row equals the row among 2..17 rows at pasts whose rows cross 64 keys."""
    m = floor_keys(_concat_layer(), D)
    node = next(n for n in m.graph.node if n.op_type == "Attention")
    p = E.OpProbe("Attention", "Attention", [node.name], 0)
    fns, why = E._attention(m, node, S.DEFAULT_THREADS, np.random.default_rng(0), S.KV_CONCAT, HEADS, past)
    assert fns is not None, why
    E._compare(p, *fns)
    assert p.rows == 35 and p.equal_padded == p.rows, p


def test_probe_pasts_cross_64_keys():
    assert {56, 60} <= set(E.ATTENTION_PASTS)
    assert any(p < 64 < p + max(E.ROWS) for p in E.ATTENTION_PASTS)
    onnx.checker.check_model(floor_keys(_concat_layer(), D))
