"""A rowwise variant's prefill graph (export.passes.rowwise_prefill, build.prefill_graph,
layouts.rowwise.RowwiseDriver.prefill / RowwiseBatch.prefill): prompt chunks as multi-row attention
over the decode graph's own buffer. The decode graph's function within float rounding, the same K/V
written, saved by reference to the variant's weights, gated, checked at load; and decoding stays
lossless: every method reproduces plain decoding on a prompt it prefills, and the server's prefill
(hand-over into its batch slot) gives the bits a request alone gets."""

import collections
import json

import numpy as np
import onnx
import pytest

from dejavuu_build import schema as S
from dejavuu_build.errors import ContractError, IntegrityError
from dejavuu_build.export.passes.rowwise_prefill import to_rowwise_prefill
from dejavuu_build.layouts import Rows
from dejavuu_build.runtime import load
from dejavuu_build.runtime.decoder import Decoder
from dejavuu_build.serve.batch import batch_decoder, measure_exact

VARIANT = "int4-rowwise"


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load(tiny_llama, variant=VARIANT)


def prefill(dec, ids, room=8):
    """``ids`` through ``dec.prefill`` in the runtime's chunks: the last row's logits, the buffer."""
    kv = dec.new_cache()
    try:
        for i in range(0, len(ids), S.PREFILL_CHUNK):
            part = ids[i : i + S.PREFILL_CHUNK]
            lg, _, pr = dec.prefill(part, kv, len(ids), room)
            kv.commit(pr, len(part), list(range(len(part))))
        return lg[-1].copy(), kv.buffers()[:, :, :, : kv.length].copy()
    finally:
        kv.release()


def test_the_pass_feeds_rows_as_rows_and_removes_only(tiny_llama):
    src = onnx.load(str(tiny_llama / S.variant_file(VARIANT)))
    names = {n.name for n in src.graph.node}
    out = to_rowwise_prefill(onnx.load(str(tiny_llama / S.variant_file(VARIANT))), "x")
    ops = collections.Counter(n.op_type for n in out.graph.node)
    layers = sum(1 for i in src.graph.input if i.name.endswith(".key"))
    atts = [n for n in out.graph.node if n.op_type == "Attention"]
    assert len(atts) == layers and all(a.input[3] == S.ATTENTION_BIAS for a in atts)
    assert not [n for n in out.graph.node if n.name.endswith("/q_rows") or "mask_" in n.name]
    assert {n.name for n in out.graph.node} < names  # nodes removed, none added or renamed
    assert ops["Reshape"] == collections.Counter(n.op_type for n in src.graph.node)["Reshape"] - layers - 1
    assert [i.name for i in out.graph.input] == [i.name for i in src.graph.input]
    used = {x for n in out.graph.node for x in n.input}
    assert all(t.name in used for t in out.graph.initializer)
    assert json.loads({p.key: p.value for p in out.metadata_props}[S.PREFILL_KEY]) == {"of": "x", "layers": layers}


def test_the_pass_refuses_a_graph_that_is_not_rowwise(tiny_llama):
    with pytest.raises(ContractError, match="not a rowwise-KV graph"):
        to_rowwise_prefill(onnx.load(str(tiny_llama / S.variant_file("int4-static"))))


def test_the_build_writes_gates_and_records_it_sharing_the_weights(tiny_llama):
    m = S.read_manifest(tiny_llama)
    for v, rec in m.variants.items():
        if rec.kv_layout != S.KV_ROWWISE:
            assert rec.prefill == {} and not (tiny_llama / S.prefill_file(v)).exists()
            continue
        p = rec.prefill
        assert p["file"] == S.prefill_file(v) and p["passed"] and p["source_sha256"] == rec.sha256
        assert m.files[p["file"]]["sha256"] == p["sha256"]
        assert p["bytes"] < p["shared_bytes"]  # the graph alone: its weights are read from the variant's file
        q, own = p["gate"], rec.gates["quality"]
        assert q["positions"] == own["positions"] > 0 and q["top1"] >= q["floor"]
        assert abs(q["top1"] - own["top1"]) <= 0.05


def test_the_runtime_prefills_through_it_with_the_decode_graphs_function(model, tiny_llama):
    """Model.load opens it; a prompt of three chunks gives the decode graph's last-row
    logits within float rounding and the same first layer's K/V bit for bit (written by the
    same projections and RoPE; only attention sums in another order)."""
    dec = model.decoder
    assert dec.prefill_s is not None
    plain = Decoder(dec.s, dec.c)  # the same decode graph, no prefill graph
    ids = np.random.default_rng(0).integers(0, dec.c.vocab_size, 2 * S.PREFILL_CHUNK + 22).tolist()
    lg, buf = prefill(dec, ids)
    ref, ref_buf = prefill(plain, ids)
    assert buf.shape == ref_buf.shape and buf.shape[3] == len(ids)
    assert np.array_equal(buf[:2], ref_buf[:2])  # layer 0's K and V
    np.testing.assert_allclose(lg, ref, rtol=0, atol=1e-3 * np.abs(ref).max())
    assert int(lg.argmax()) == int(ref.argmax())


@pytest.mark.parametrize("method,tree", [("pld", False), ("suffix_vote", False), ("auto", False), ("pld", True)])
def test_every_method_reproduces_plain_decoding_on_a_prefilled_prompt(model, method, tree):
    """A prompt of three chunks, copy-friendly so drafts are accepted: tokens equal to plain
    decoding on the same decoder (prefill shared)."""
    assert model.decoder.prefill_s is not None
    words = "the cat sat on the mat and the dog sat on the log " * 6
    base = model.generate(words, max_new_tokens=40)
    assert base.prompt_tokens > 2 * S.PREFILL_CHUNK
    out = model.generate(words, method=method, tree=tree, max_new_tokens=40)
    assert out.tokens == base.tokens and out.stats.accepted > 0  # drafts were verified and taken


def test_the_server_hands_a_prompt_over_bit_identical_to_alone(model, tiny_llama):
    """serve.batch.measure_exact with the model's decoder: every request prefilled by
    RowwiseBatch.prefill (the prefill graph, then its rows copied into the slot), its last row and
    every later step equal to a request alone; prompts of one and two chunks (buffer growths)."""
    m = S.read_manifest(tiny_llama)
    path = tiny_llama / m.batched["file"] if m.batched.get("variant") == VARIANT else None
    if path is None:  # the tiny entry batches its static default: write the rowwise one here
        from dejavuu_build.export.passes.serve_batch_rowwise import to_serve_batch_rowwise

        path = tiny_llama.parent / "rowwise-prefill-batched.onnx"
        onnx.save(to_serve_batch_rowwise(onnx.load(str(tiny_llama / S.variant_file(VARIANT)))), str(path))
    batch = batch_decoder(model.decoder, path, 3, 1)
    C = S.PREFILL_CHUNK
    res = measure_exact(model.decoder, batch, ((C + 22, (1, 8, 3)), (C - 58, (5, 1, 2)), (9, (2, 2, 1))), seed=5)
    assert res["passed"] and res["steps_checked"] == 12, res
    assert batch.active == 0 and not batch._prefilling

    # a request leaving mid-prefill: the last slot's prompt moves into its slot and goes on exactly
    rng = np.random.default_rng(7)
    p0, p1 = (rng.integers(0, model.contract.vocab_size, n).tolist() for n in (C + 72, C + 12))
    want, _ = prefill(model.decoder, p1, room=4)
    a, b = batch.acquire("a"), batch.acquire("b")
    for s, p in ((a, p0), (b, p1)):
        batch.prefill(s, Rows(p[: S.PREFILL_CHUNK], None), len(p), 4)
        batch.commit(s, S.PREFILL_CHUNK, list(range(S.PREFILL_CHUNK)))
    assert batch.release(a) == "b" and set(batch._prefilling) == {a}
    for i in range(S.PREFILL_CHUNK, len(p1), S.PREFILL_CHUNK):
        part = p1[i : i + S.PREFILL_CHUNK]
        lg, _ = batch.prefill(a, Rows(part, None), len(p1), 4)
        batch.commit(a, len(part), list(range(len(part))))
    assert np.array_equal(lg[-1], want) and not batch._prefilling
    batch.release(a)


def test_a_load_checks_the_record(model, tiny_llama, tmp_path):
    """A prefill graph made from other variant bytes is refused; one that failed its gate is not
    used (prompts run on the decode graph)."""
    import shutil

    entry = tmp_path / "entry"
    shutil.copytree(tiny_llama, entry)
    m = json.loads((entry / S.MANIFEST_FILE).read_text())
    rec = m["variants"][VARIANT]["prefill"]
    rec["source_sha256"] = "0" * 64
    (entry / S.MANIFEST_FILE).write_text(json.dumps(m))
    with pytest.raises(IntegrityError, match="prefill graph of int4-rowwise was made from another"):
        load(entry, variant=VARIANT)
    rec["source_sha256"] = m["variants"][VARIANT]["sha256"]
    rec["passed"] = False
    (entry / S.MANIFEST_FILE).write_text(json.dumps(m))
    assert load(entry, variant=VARIANT).decoder.prefill_s is None
