"""The default build (--variants auto) on a tiny random Llama: what it writes, when it adds int8,
and quant-only gating only what it rewrote."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from dejavuu_build import precisions as P
from dejavuu_build import schema as S
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build.pipeline import build_tree_decoder, quant_only

INT4 = ["fp32", "int4", "int4-static", "int4-rowwise"]


def _build(cache_dir, name: str, seed: int = 0):
    from tiny import save_tiny

    src = save_tiny("llama", cache_dir.parent / f"src-{name}", seed=seed)
    return build_tree_decoder(TreeDecoderConfig(model=str(src), name=name, timing=False, reference_tokens=12))


@pytest.fixture(scope="module")
def auto_build(cache_dir):
    return _build(cache_dir, "auto-llama")


def test_auto_writes_fp32_and_the_int4_flavours(auto_build):
    m = auto_build.manifest
    assert sorted(m.variants, key=S.variant_order) == INT4
    assert m.build_config["variants"] == []
    files = {p.name for p in auto_build.folder.iterdir()}
    assert not any(f.startswith(("decoder_int8", "decoder_fp32-", ".pre-guard-")) for f in files), files
    assert all(m.variants[v].passed for v in INT4) and m.default_variant in INT4[1:]
    names = [n for n, _ in m.steps]  # where the time went, in order
    assert names[0].startswith("load ") and names[1].startswith("export fp32")
    assert any(n.startswith("validate int4") for n in names)
    assert all(sec >= 0 for _, sec in m.steps)


def test_an_auto_build_writes_the_default_prefill_graph_only(auto_build, caplog):
    """An auto build writes a rowwise variant's prefill graph only where it is the default (the
    untimed build's default here: int4-static); int4-rowwise records why it has none, and the
    runtime opens it, says its prompts run on the decode graph and why, and decodes plainly as
    fast drafting does (same tokens)."""
    from dejavuu_build.runtime import load

    m = auto_build.manifest
    assert m.default_variant == "int4-static"
    rec = m.variants["int4-rowwise"].prefill
    assert rec["skipped"].startswith("not the default (int4-static)") and "file" not in rec
    assert not (auto_build.folder / S.prefill_file("int4-rowwise")).exists()
    with caplog.at_level(logging.INFO, logger="dejavuu"):
        model = load(auto_build.folder, variant="int4-rowwise")
    assert "int4-rowwise: no prefill graph (not the default (int4-static)" in caplog.text
    plain = model.generate("the cat sat on the mat. the cat", max_new_tokens=12)
    drafted = model.generate("the cat sat on the mat. the cat", max_new_tokens=12, method="pld")
    assert plain.tokens == drafted.tokens and len(plain.tokens) > 0


def test_quant_only_gates_only_what_it_rewrote(auto_build):
    before = S.read_manifest(auto_build.folder)
    # int8 is new: gated; int4 and fp32 are carried, their gates measured here already
    after = quant_only("auto-llama", variants=("int8",), timing=False).manifest
    names = [n for n, _ in after.steps]
    assert "validate int8" in names and "validate int8-rowwise" in names, names
    assert not any(n in names for n in ("validate fp32", "validate int4", "validate int4-rowwise")), names
    for v in INT4:
        assert (
            after.variants[v].gates == before.variants[v].gates
            and after.variants[v].sha256 == before.variants[v].sha256
        )
    assert after.variants["int8"].passed and "quality" in after.variants["int8"].gates
    assert after.build_config["variants"] == ["fp32", "int8", "int4"]  # no longer what auto builds
    # the batched serving graph follows the default variant: rewritten byte for byte, its gate holds
    assert after.batched == before.batched and before.batched["variant"] == before.default_variant
    assert (auto_build.folder / after.batched["file"]).is_file() and after.batched["file"] in after.files
    # int4 again: the deterministic quantizer rewrites the same bytes, whose gates hold
    again = quant_only("auto-llama", variants=("int4",), timing=False).manifest
    names = [n for n, _ in again.steps]
    assert any(n.startswith("quantize int4") for n in names) and not any(n.startswith("validate") for n in names), names
    for v in INT4[1:]:
        assert again.variants[v].sha256 == before.variants[v].sha256 and again.variants[v].passed, v
    # a changed file is gated again: make the recorded int4 differ from what the quantizer writes
    m = S.read_manifest(auto_build.folder)
    m.variants["int4"].sha256 = "0" * 64
    m.files[m.variants["int4"].file]["sha256"] = "0" * 64  # quant-only never reads what it redoes
    S.write_json(auto_build.folder / S.MANIFEST_FILE, m.to_json())
    third = quant_only("auto-llama", variants=("int4",), timing=False).manifest
    names = [n for n, _ in third.steps]
    assert "validate int4" in names and "validate int4-rowwise" not in names, names
    assert third.variants["int4"].passed and third.variants["int4"].sha256 == before.variants["int4"].sha256
    assert third.batched == before.batched


def test_auto_adds_int4op_then_int8_when_int4_loses_the_answers(cache_dir, monkeypatch, caplog):
    # No variant can reach a top-1 above 1: the build must add the next tiers, int4op then int8, in
    # every layout (and never fp32's flavours).
    for name in P.quantized():  # the default floors are each precision's (the precisions table)
        monkeypatch.setitem(P.PRECISIONS, name, replace(P.PRECISIONS[name], default_top1=1.01, default_mean_kl=0.0))
    with caplog.at_level(logging.INFO, logger="dejavuu"):
        m = _build(cache_dir, "auto-int8", seed=1).manifest
    int4op = ["int4op", "int4op-static", "int4op-rowwise"]
    assert sorted(m.variants, key=S.variant_order) == (
        INT4[:1] + ["int8", "int8-static", "int8-rowwise"] + INT4[1:] + int4op
    )
    assert "int4 does not keep the model's answers here" in caplog.text and "int4-rowwise: top-1" in caplog.text
    assert "int4 or int4op does not keep the model's answers here" in caplog.text
    assert all("quality" in m.variants[v].gates for v in m.variants if v != "fp32")
    assert m.default_variant is not None and m.variants[m.default_variant].passed


def test_the_unguarded_export_is_kept_by_a_link_for_later_tiers(tmp_path):
    """keep_unguarded: the fp32 export's bytes before its guard stay under a second name (the guard
    writes a new file and renames it over), later quantize calls read them (unguarded), and
    drop_unguarded leaves nothing of them; an export with external data is not linked."""
    import os

    from dejavuu_build.build.row_guard import PRE_GUARD_PREFIX, drop_unguarded, keep_unguarded, unguarded

    path = tmp_path / "decoder_fp32.onnx"
    path.write_bytes(b"unguarded")
    keep_unguarded(path)
    kept = tmp_path / (PRE_GUARD_PREFIX + path.name)
    assert kept.samefile(path)
    new = tmp_path / "decoder_fp32.onnx.guard.tmp"
    new.write_bytes(b"guarded")
    os.replace(new, path)  # as guard_variant writes the guarded graph
    with unguarded(path, True) as src:
        assert src == kept and src.read_bytes() == b"unguarded"
    drop_unguarded(tmp_path)
    assert not kept.exists() and path.read_bytes() == b"guarded"
    (tmp_path / "decoder_fp32.onnx.data").write_bytes(b"weights")
    keep_unguarded(path)
    assert not kept.exists()
