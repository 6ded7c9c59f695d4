"""The precisions table drives every reader: a precision registered there alone is accepted by the
CLIs and the config, quantized by its plan, gated at its floors, placed in the auto build by its tier
and judged for the default by its default floors."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_trust_cli import invoke

from dejavuu_build import precisions as P
from dejavuu_build import schema as S
from dejavuu_build.build import cli, default, pipeline
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.errors import DejavuuError
from dejavuu_build.schema import VariantRecord

SYM = "int4sym"  # a throwaway precision: int4 rounded symmetric, floors no other precision has


def _throwaway(**kw) -> P.Precision:
    return P.Precision(
        SYM,
        replace(P.plan(S.INT4), symmetric=True),
        teacher_forced_floor=0.125,
        quality_floor=0.0625,
        default_top1=0.0,
        default_mean_kl=100.0,
        **kw,
    )


@pytest.fixture
def registered():
    p = P.register(_throwaway())
    try:
        yield p
    finally:
        P.PRECISIONS.pop(SYM, None)


def test_register_refuses_a_second_entry_a_reference_and_a_bad_name(registered):
    with pytest.raises(ValueError, match="already registered"):
        P.register(_throwaway())
    with pytest.raises(ValueError, match="reference"):
        P.register(P.Precision("int2", None, teacher_forced_floor=0.5, quality_floor=0.5))
    with pytest.raises(ValueError, match="lower-case letters and digits"):
        P.Precision("int4-x", None, teacher_forced_floor=0.5, quality_floor=0.5)


def test_the_readers_see_a_registered_precision(registered):
    assert P.names()[-1] == SYM and SYM in P.quantized() and P.plan(SYM).symmetric
    assert S.variant_order(SYM) == (len(P.names()) - 1, 0) and S.variant_order(SYM + "-static")[0] == len(P.names()) - 1
    assert S.split_variant(SYM + "-rowwise") == (SYM, S.KV_ROWWISE)
    assert cli._variants(f"fp32,{SYM}") == ("fp32", SYM)
    TreeDecoderConfig(model="./m", variants=("fp32", SYM)).validate()
    assert P.quality_floors()[SYM] == 0.0625
    assert pipeline._requant_variants(S.Manifest(variants={"fp32": VariantRecord("f")}), (SYM, "int4")) == [
        "fp32",
        "int4",
        SYM,
    ]
    P.PRECISIONS.pop(SYM)
    with pytest.raises(DejavuuError, match="among fp32, int8, int4, int4op "):
        TreeDecoderConfig(model="./m", variants=("fp32", SYM)).validate()


def test_the_auto_build_follows_the_tiers(monkeypatch):
    assert P.auto_tiers() == [(S.INT4,), (P.INT4OP,), (S.INT8,)]
    monkeypatch.setitem(P.PRECISIONS, SYM, _throwaway(auto_tier=1))
    assert P.auto_tiers() == [(S.INT4, SYM), (P.INT4OP,), (S.INT8,)]
    assert "int4 and int4sym in every KV layout (int4op too when no int4 or int4sym keeps" in cli._auto_help()
    assert "(int8 too when no int4op keeps" in cli._auto_help()


def test_the_default_floors_are_each_precisions(monkeypatch):
    rec = VariantRecord("f", gates={"quality": {"top1": 0.9, "mean_kl": 0.01}})
    assert not default.keeps_answers(S.INT4, rec) and default.keeps_answers(S.FP32, VariantRecord("f"))
    monkeypatch.setitem(P.PRECISIONS, S.INT4, replace(P.PRECISIONS[S.INT4], default_top1=0.85))
    assert default.keeps_answers(S.INT4, rec) and default.keeps_answers("int4-rowwise", rec)
    assert not default.keeps_answers(S.INT8, rec)
    assert default.default_floors_line() == (
        "int8: top-1 >= 0.95, mean KL <= 0.02; int4: top-1 >= 0.85, mean KL <= 0.02; "
        "int4op: top-1 >= 0.95, mean KL <= 0.02"
    )


def test_a_build_of_a_registered_precision_reads_only_the_table(cache_dir, registered):
    """A build with --variants fp32,int4sym: its plan quantized, its floors gated, its default floors
    judged, quant-only (CLI) redoing it byte for byte."""
    from tiny import save_tiny

    src = save_tiny("llama", cache_dir.parent / "src-prec-sym")
    cfg = TreeDecoderConfig(
        model=str(src),
        name="prec-sym",
        variants=("fp32", SYM),
        timing=False,
        reference_tokens=12,
        kv_layouts=(S.KV_CONCAT,),
    )
    m = pipeline.build_tree_decoder(cfg).manifest
    assert sorted(m.variants, key=S.variant_order) == ["fp32", SYM]
    rec = m.variants[SYM]
    assert rec.quant["plan"] == registered.plan.to_json()
    body = [n for k, n in rec.quant["nodes"].items() if "/layers." in k]
    assert body and all(n.endswith("q4 bs32 sym") for n in body), body  # the plan's symmetric rounding
    assert rec.gates["teacher_forced"]["floor"] == 0.125 and rec.gates["quality"]["floor"] == 0.0625
    assert rec.passed and m.default_variant == SYM  # its default floors (0 / 100) are met
    assert f"{SYM}: top-1 >= 0.0, mean KL <= 100.0" in m.default_reason["rule"]
    r = invoke("quant-only", "--name", "prec-sym", "--variants", SYM, "--no-timing")
    assert r.exit_code == 0, r.output
    again = S.read_manifest(cache_dir / "prec-sym")
    assert again.variants[SYM].sha256 == rec.sha256 and again.build_config["variants"] == ["fp32", SYM]
