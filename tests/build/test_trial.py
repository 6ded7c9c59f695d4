"""The auto build's speed trial of the next tier (build.trial): int8 is quantized, written in the
preferred candidate's layout, timed against it, and kept (gated, a default candidate) only where it
is clearly faster by the picker's rule; else nothing of it stays and the manifest says what was
measured. Its concat base never stays: the timed flavour is what the entry keeps."""

from __future__ import annotations

import pytest

from dejavuu_build import schema as S
from dejavuu_build.build import trial
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build.default import MIN_ROUNDS, settled
from dejavuu_build.build.pipeline import build_tree_decoder


def _fake_timing(ratio: float | dict[str, float]):
    """time_interleaved whose trial variant costs about ``ratio`` times the one it is judged
    against (+-1%); per precision where a mapping."""

    def timed(sessions, rounds, **kw):
        first, name = list(sessions)
        # the trial stops by the picker's own rule on its two candidates, never before MIN_ROUNDS
        assert kw["min_rounds"] == MIN_ROUNDS and kw["settled"].keywords == {"first": first}
        assert kw["settled"].func is settled
        r = ratio[S.split_variant(name)[0]] if isinstance(ratio, dict) else ratio
        base = [10.0, 10.5, 10.2, 9.9, 10.1][:rounds]
        wobble = [1.0, 1.01, 0.99, 1.0, 1.005][:rounds]
        return {
            first: {"timings_ms": {}, "round_costs_ms": base},
            name: {"timings_ms": {}, "round_costs_ms": [b * r * w for b, w in zip(base, wobble)]},
        }

    return timed


def _build(cache_dir, name: str, monkeypatch, ratio: float | dict[str, float], operator: bool = True):
    from tiny import save_tiny

    from dejavuu_build import kernels

    if not operator:
        monkeypatch.setattr(kernels, "unavailable", lambda ops: "no C++ compiler found")
    monkeypatch.setattr(trial, "time_interleaved", _fake_timing(ratio))
    src = save_tiny("llama", cache_dir.parent / f"src-{name}", seed=0)
    return build_tree_decoder(TreeDecoderConfig(model=str(src), name=name, timing=True, reference_tokens=12))


@pytest.mark.slow
def test_a_slower_trial_leaves_nothing_but_its_record(cache_dir, monkeypatch):
    r = _build(cache_dir, "trial-slow", monkeypatch, ratio=1.3)
    m = r.manifest
    assert not any(S.split_variant(v)[0] in ("int8", "int4op") for v in m.variants), sorted(m.variants)
    assert not any(p.name.startswith(("decoder_int8", "decoder_int4op", ".pre-guard-")) for p in r.folder.iterdir())
    assert m.quantize["variants"] == ["int4"]
    trials = m.default_reason["trials"]
    assert [S.split_variant(n)[0] for n in trials] == ["int4op", "int8"]  # the tiers' order
    for name, rec in trials.items():
        assert name == S.variant_name(S.split_variant(name)[0], S.split_variant(rec["against"])[1])
        assert rec["kept"] is False and rec["ratio"] == pytest.approx(1.3, abs=0.01)
        assert rec["against"] == m.default_reason["preferred"]
        assert any(n.startswith(f"trial of {name}") for n, _ in m.steps)
    assert S.read_manifest(r.folder).default_reason["trials"] == m.default_reason["trials"]  # written


@pytest.mark.slow
def test_a_later_faster_trial_replaces_an_earlier_one(cache_dir, monkeypatch):
    """int4op kept against int4's flavour, then int8 judged against int4op's and clearly faster:
    int8's flavour stays, int4op's goes (its record says by what), one trial flavour in the entry."""
    r = _build(cache_dir, "trial-twice", monkeypatch, ratio={"int8": 0.7, "int4op": 0.7})
    m = r.manifest
    (nop, rop), (n8, r8) = m.default_reason["trials"].items()
    assert S.split_variant(n8)[0] == "int8" and S.split_variant(nop)[0] == "int4op"
    assert r8["kept"] is True and r8["against"] == nop
    assert rop["kept"] is False and rop["superseded_by"] == n8
    assert nop not in m.variants and not any(p.name.startswith("decoder_int4op") for p in r.folder.iterdir())
    assert m.variants[n8].passed and n8 in m.default_reason["candidates"]
    assert m.quantize["variants"] == ["int4", "int8"]


@pytest.mark.slow
def test_a_trial_whose_operator_cannot_run_here_is_skipped_and_said(cache_dir, monkeypatch):
    r = _build(cache_dir, "trial-no-op", monkeypatch, ratio=1.3, operator=False)
    rec = next(rec for n, rec in r.manifest.default_reason["trials"].items() if n.startswith("int4op"))
    assert rec == {"against": r.manifest.default_reason["preferred"], "kept": False, "skipped": "no C++ compiler found"}
    assert not any(p.name.startswith("decoder_int4op") for p in r.folder.iterdir())


@pytest.mark.slow
def test_a_faster_trial_is_gated_and_becomes_a_candidate(cache_dir, monkeypatch):
    r = _build(cache_dir, "trial-fast", monkeypatch, ratio={"int8": 0.7, "int4op": 1.3})
    m = r.manifest
    (other, orec), (name, rec) = m.default_reason["trials"].items()
    assert rec["kept"] is True and orec["kept"] is False and rec["against"] == orec["against"]
    assert name != "int8" and "int8" not in m.variants  # the flavour stays, its concat base does not
    assert not (r.folder / S.variant_file("int8")).exists()
    assert m.variants[name].passed and "quality" in m.variants[name].gates  # gated like every variant
    assert (r.folder / m.variants[name].file).is_file() and m.variants[name].file in m.files
    assert m.variants[name].row_guard  # its rows measured (and guarded where needed) on this machine
    assert name in m.default_reason["candidates"]
    assert rec["cost_ratio"]["median"] == pytest.approx(0.7, abs=0.01) and rec["cost_ratio"]["error"] < 0.01
    assert m.quantize["variants"] == ["int4", "int8"]

    # an untimed quant-only keeps the kept flavour, the default the build's timing chose, and its record
    from dejavuu_build.build.pipeline import quant_only

    after = quant_only("trial-fast", variants=("int4",), timing=False).manifest
    assert name in after.variants and after.variants[name].sha256 == m.variants[name].sha256
    assert after.default_variant == m.default_variant
    assert after.default_reason["trials"] == m.default_reason["trials"]


@pytest.mark.slow
def test_a_trial_within_the_tie_band_is_not_kept(cache_dir, monkeypatch):
    """2% faster with no noise at all is a tie (MIN_SPEEDUP): the smaller int4 stays."""
    from dejavuu_build.build.default import MIN_SPEEDUP

    r = _build(cache_dir, "trial-tie", monkeypatch, ratio=0.98)
    recs = r.manifest.default_reason["trials"].values()
    assert 0.98 > 1 - MIN_SPEEDUP and not any(rec["kept"] for rec in recs)
    assert not any(S.split_variant(v)[0] in ("int8", "int4op") for v in r.manifest.variants)
