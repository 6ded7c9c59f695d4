"""LOGITS_FROM (export.passes.common.slice_logits): an in-place flavour's lm-head reads the rows
from an input, so a prefill gets its last row's logits bit-identical to the full run's, in every
precision and in-place layout; the concat export (what other runtimes load) keeps every row and has
no such input; batched serving graphs return every row (export.passes.common.drop_logits_slice)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from dejavuu_build import schema as S
from dejavuu_build.runtime.decoder import Decoder
from dejavuu_build.runtime.session import derive_contract, make_session

IN_PLACE = ("fp32-static", "fp32-rowwise", "int8-static", "int8-rowwise", "int4-static", "int4-rowwise")


@pytest.fixture(scope="module")
def entry(cache_dir):
    from conftest import build_tiny

    return build_tiny("llama", cache_dir)


def _full_and_sliced(path, rows: int, last: int):
    """The same prefill run twice through the runtime's Decoder: every row's logits, then asking
    for the ``last`` rows' only (Decoder.forward's ``last``, as the engine's prefill does)."""
    sess = make_session(path, threads=1)
    dec = Decoder(sess, derive_contract(sess))
    toks = [int(t) for t in np.random.default_rng(rows).integers(3, 60, rows)]
    out = []
    for feed in (None, last):
        kv = dec.new_cache()
        try:
            out.append(dec.forward(toks, None, kv, last=feed)[0].copy())
        finally:
            kv.release()
    return out


@pytest.mark.parametrize("variant", IN_PLACE)
def test_the_last_rows_logits_alone_equal_the_full_runs(entry, variant):
    path = entry / S.variant_file(variant)
    assert S.LOGITS_FROM in {i.name for i in make_session(path, threads=1).get_inputs()}
    for rows in (1, 2, 9, 33):
        full, last = _full_and_sliced(path, rows, 1)
        assert full.shape[0] == rows and last.shape[0] == 1  # every in-place graph: a lone row is one row
        np.testing.assert_array_equal(last, full[-last.shape[0] :])


@pytest.mark.parametrize("variant", ("fp32", "int4"))
def test_the_concat_export_has_no_slice_and_returns_every_row(entry, variant):
    path = entry / S.variant_file(variant)
    assert S.LOGITS_FROM not in {i.name for i in make_session(path, threads=1).get_inputs()}
    full, last = _full_and_sliced(path, 9, 1)
    np.testing.assert_array_equal(last, full)


def test_batched_serving_graphs_return_every_row(entry, cache_dir):
    from conftest import build_tiny

    rowwise = build_tiny("llama", cache_dir, variants=("fp32", "int4"), name="tiny-llama-auto")
    m = S.read_manifest(rowwise)
    assert m.batched.get("file"), m.batched
    g = onnx.load(str(rowwise / m.batched["file"])).graph
    assert S.LOGITS_FROM not in {i.name for i in g.input}
    assert not any(n.op_type == "Slice" and S.LOGITS_FROM in n.input for n in g.node)
    unbatched = onnx.load(str(rowwise / S.variant_file(m.batched["variant"]))).graph
    assert sum(n.op_type == "Slice" and S.LOGITS_FROM in n.input for n in unbatched.node) == 1
