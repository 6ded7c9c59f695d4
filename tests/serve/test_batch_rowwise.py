"""The rowwise batched serving graph (export.passes.serve_batch_rowwise, layouts.rowwise.RowwiseBatch)
on a tiny build: B > 1 requests really run in one forward, and each request's logits are
bit-identical to decoding it alone with the rowwise Decoder, whatever its past, its row count,
the others' row counts, the batch's buffer length, or a slot move when another request leaves."""

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from dejavuu_build import schema as S
from dejavuu_build.errors import ContractError
from dejavuu_build.export.passes.serve_batch_rowwise import batch_one_reshapes, to_serve_batch_rowwise
from dejavuu_build.layouts import Rows
from dejavuu_build.layouts.rowwise import RowwiseBatch
from dejavuu_build.runtime import load
from dejavuu_build.serve.batch import batch_decoder, measure_exact

VARIANT = "int4-rowwise"


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load(tiny_llama, variant=VARIANT)


@pytest.fixture(scope="module")
def batched_path(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("rowwise-batch") / "batched.onnx"
    onnx.save(to_serve_batch_rowwise(onnx.load(str(tiny_llama / S.variant_file(VARIANT)))), str(path))
    return path


def alone(dec, prompt, steps):
    """The rowwise Decoder's logits for ``prompt`` and then each step of ``steps``, one request alone."""
    kv = dec.new_cache()
    try:
        out = []
        for toks in [prompt, *steps]:
            lg, _, _ = dec.forward(toks, None, kv)
            kv.commit(None, len(toks), list(range(len(toks))))
            out.append(lg.copy())
        return out
    finally:
        kv.release()


def test_the_pass_batches_every_reshape_and_io(tiny_llama):
    proto = onnx.load(str(tiny_llama / S.variant_file(VARIANT)))
    assert batch_one_reshapes(proto)  # the rowwise graph pins batch 1 (its q rows, its mask, its heads)
    out = to_serve_batch_rowwise(proto)
    assert batch_one_reshapes(out) == []
    for v in [*out.graph.input, *out.graph.output]:
        assert v.type.tensor_type.shape.dim[0].dim_param == "batch", v.name


def test_requests_side_by_side_are_bit_identical_to_alone(model, batched_path):
    """Different pasts (the batch's buffer longer than each alone's), different row counts per
    step (a lone token beside 8 rows), prefill through the batch: every logit bit-equal."""
    dec = model.decoder
    batch = batch_decoder(dec, batched_path, 4, 1)
    assert isinstance(batch, RowwiseBatch) and batch.single_rows == 1
    cases = ((5, (1, 8, 2, 1)), (130, (8, 1, 1, 3)), (40, (1, 1, 5, 8)), (300, (2, 3, 1, 1)))
    res = measure_exact(dec, batch, cases, seed=3)
    assert res["passed"] and res["requests"] == 4 and res["steps_checked"] == 20, res
    assert batch.active == 0 and batch.size == 0  # every slot back, the buffer released


def test_a_forward_of_several_requests_runs_them_all(model, batched_path):
    """B = 3 requests in one forward: each gets logits for its own rows, equal to alone (fails on
    any Reshape still pinned to batch 1: onnxruntime cannot run B > 1 through it)."""
    dec = model.decoder
    batch = batch_decoder(dec, batched_path, 3, 1)
    rng = np.random.default_rng(0)
    V = dec.c.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (9, 17, 3)]
    steps = [rng.integers(0, V, n).tolist() for n in (1, 6, 3)]
    slots = [batch.acquire(None) for _ in prompts]
    for s, p in zip(slots, prompts):
        batch.forward(s, [Rows(p, None)])
        batch.commit(s, len(p), list(range(len(p))))
    outs = batch.forward(0, [Rows(t, None) for t in steps])
    for (lg, hd), p, t in zip(outs, prompts, steps):
        assert lg.shape == (len(t), V) and hd is not None and hd.shape[0] == len(t)
        assert np.array_equal(lg, alone(dec, p, [t])[1])


def test_a_reshape_left_at_batch_one_is_caught(model, tiny_llama, tmp_path):
    """The check above can fail: the batched graph with one rewritten Reshape put back to batch 1
    does not run B = 2 requests."""
    proto = to_serve_batch_rowwise(onnx.load(str(tiny_llama / S.variant_file(VARIANT))))
    g = proto.graph
    node = next(n for n in g.node if n.op_type == "Reshape" and n.input[1].endswith("/batched"))
    t = next(x for x in g.initializer if x.name == node.input[1])
    shape = numpy_helper.to_array(t).copy()
    shape[0] = 1
    t.CopyFrom(numpy_helper.from_array(shape, t.name))
    path = tmp_path / "pinned.onnx"
    onnx.save(proto, str(path))
    batch = batch_decoder(model.decoder, path, 2, 1)
    for _ in range(2):
        batch.acquire(None)
    with pytest.raises(Exception, match="Non-zero status code"):  # onnxruntime refuses to run it
        batch.forward(0, [Rows([1, 2, 3], None), Rows([4, 5], None)])


def test_a_request_leaving_moves_the_last_and_shrinks_the_buffer(model, batched_path):
    """Slot 0's long request leaves: the last request moves into its slot, the buffer shrinks to
    the others' lengths, and both keep decoding bit-identical to alone."""
    dec = model.decoder
    batch = batch_decoder(dec, batched_path, 3, 1)
    rng = np.random.default_rng(1)
    V = dec.c.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (400, 12, 30)]
    steps = [[rng.integers(0, V, n).tolist() for n in st] for st in ((2, 1), (1, 4, 2, 1), (3, 1, 1, 5))]
    want = [alone(dec, p, st) for p, st in zip(prompts, steps)]
    slots = [batch.acquire(k) for k in range(3)]
    for s, p in zip(slots, prompts):
        (got,) = batch.forward(s, [Rows(p, None)])
        assert np.array_equal(got[0], want[s][0])
        batch.commit(s, len(p), list(range(len(p))))
    owner = {0: 0, 1: 1, 2: 2}  # slot -> request
    for j in range(4):
        if j == 2:  # request 0 leaves: request 2 moves into slot 0
            before = batch.size
            assert batch.release(0) == 2 and batch.active == 2
            owner = {0: 2, 1: 1}
            assert batch.size < before and batch.size % 64 == 0
        rows = [Rows(steps[owner[s]][j], None) for s in range(batch.active)]
        outs = batch.forward(0, rows)
        for s in range(batch.active):
            assert np.array_equal(outs[s][0], want[owner[s]][j + 1]), (j, owner[s])
            batch.commit(s, len(rows[s].tokens), list(range(len(rows[s].tokens))))


def test_pad_rows_past_the_capacity_get_room(model, batched_path):
    """A request near the capacity beside one with many rows: the other's pad rows would be written
    past the capacity; the buffer makes room for them (a fresh memory) and both stay exact."""
    dec = model.decoder
    batch = batch_decoder(dec, batched_path, 2, 1)
    rng = np.random.default_rng(2)
    V, cap = dec.c.vocab_size, dec.c.kv_capacity
    prompts = [rng.integers(0, V, n).tolist() for n in (cap - 3, 10)]
    steps = [rng.integers(0, V, n).tolist() for n in (2, 100)]
    want = [alone(dec, p, [t]) for p, t in zip(prompts, steps)]
    slots = [batch.acquire(None) for _ in prompts]
    for s, p in zip(slots, prompts):
        batch.forward(s, [Rows(p, None)])
        batch.commit(s, len(p), list(range(len(p))))
    room = batch.room
    outs = batch.forward(0, [Rows(t, None) for t in steps])
    assert batch.size > room >= cap and batch.room > room
    for (lg, _), w in zip(outs, want):
        assert np.array_equal(lg, w[1])


def test_a_row_guarded_graph_batches(model, tiny_llama, tmp_path):
    """Where the probe guards the projections (an AVX2 CPU's 4-bit kernels: a lone row padded to
    two inside the graph), the batched graph keeps the guard per request: lone tokens side by side
    (B requests of one row each) and mixed row counts stay bit-identical to the guarded graph alone."""
    from dejavuu_build.export.exporter import save_model
    from dejavuu_build.export.passes.row_guard import guard_rows, strip_row_guard
    from dejavuu_build.runtime.decoder import Decoder
    from dejavuu_build.runtime.session import make_session

    proto = strip_row_guard(onnx.load(str(tiny_llama / S.variant_file(VARIANT))))
    nodes = [n.name for n in proto.graph.node if n.op_type == "MatMulNBits"]
    guarded = tmp_path / "guarded.onnx"
    save_model(guard_rows(proto, nodes, length_invariant=True, record={"guarded": ["MatMulNBits"]}), guarded)
    assert any("/row_guard/Pad" in n.name for n in onnx.load(str(guarded)).graph.node)
    path = tmp_path / "guarded.batched.onnx"
    save_model(to_serve_batch_rowwise(onnx.load(str(guarded))), path)
    dec = Decoder(make_session(guarded, 1), model.contract)
    batch = batch_decoder(dec, path, 3, 1)
    for cases in (((5, (1, 1, 1)), (9, (1, 1, 1)), (70, (1, 1, 1))), ((11, (1, 3, 8)), (70, (5, 1, 1)))):
        res = measure_exact(dec, batch, cases)
        assert res["passed"] and res["mismatches"] == 0, res


def test_the_pass_refuses_what_it_cannot_batch_exactly(tiny_llama):
    """A graph whose row guard record says it is not length-invariant (side by side its rows would
    get other bits), or a static one, is refused with the reason."""
    proto = onnx.load(str(tiny_llama / S.variant_file(VARIANT)))
    for p in proto.metadata_props:
        if p.key == S.ROW_GUARD_KEY:
            p.value = json.dumps({**json.loads(p.value), "length_invariant": False, "not_exact": ["MatMulNBits"]})
    with pytest.raises(ContractError, match="not length-invariant"):
        to_serve_batch_rowwise(proto)
    with pytest.raises(ContractError, match="not a rowwise"):
        to_serve_batch_rowwise(onnx.load(str(tiny_llama / S.variant_file("int4-static"))))


def test_the_static_batched_graph_still_batches_its_variant(tiny_llama, tmp_path):
    """The static flavour (`serve --variant <a static default>`) keeps working: made on the fly
    here, since the build writes the batched graph of the default's layout only."""
    from dejavuu_build.export.passes.serve_batch import to_serve_batch
    from dejavuu_build.export.passes.static_kv import ROW_FLOOR_PREFIX
    from dejavuu_build.layouts.static import StaticBatch
    from dejavuu_build.serve.batch import START_CHECK

    path = tmp_path / "static.batched.onnx"
    single = onnx.load(str(tiny_llama / S.variant_file("int4-static")))
    assert any(ROW_FLOOR_PREFIX in n.name for n in single.graph.node)  # the single graph floors GQA's rows
    batched = to_serve_batch(single)
    assert not any(ROW_FLOOR_PREFIX in n.name and n.op_type in ("Pad", "Slice") for n in batched.graph.node)
    onnx.save(batched, str(path))
    m = load(tiny_llama, variant="int4-static")
    batch = batch_decoder(m.decoder, path, 2, 1)
    # a lone token: one row in two attention slots, as the single graph's floor runs it
    assert type(batch) is StaticBatch and batch.single_rows == m.decoder.single_rows == 1
    res = measure_exact(m.decoder, batch, START_CHECK)
    assert res["passed"] and res["requests"] == 2, res
