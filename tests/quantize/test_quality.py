"""The quality gate: teacher-forced top-1 agreement and KL against the fp32 export, recorded per variant."""

import numpy as np
from scipy.special import softmax
from scipy.stats import entropy

from dejavuu_build.build.quality import QUALITY_TOKENS, QualitySet, gate_quality
from dejavuu_build.build.quality_texts import TEXTS
from dejavuu_build.schema import read_manifest


class _Fixed:
    """A runner whose prefill returns given logits for the last len(table) positions."""

    def __init__(self, table):
        self.table = table

    def prefill(self, seq):
        pad = np.zeros((len(seq) - len(self.table), self.table.shape[1]), np.float32)
        return np.concatenate([pad, self.table]), None, None


def test_top1_and_kl_are_what_they_say():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((6, 11)).astype(np.float32) * 3
    near = ref + rng.standard_normal(ref.shape).astype(np.float32) * 0.3
    far = rng.standard_normal(ref.shape).astype(np.float32) * 3
    qs = QualitySet([np.arange(4)], [np.arange(6)], "t")  # 4 prompt ids, 6 continuation positions
    res = gate_quality(_Fixed(ref), {"int8": _Fixed(near), "int4": _Fixed(far)}, qs, {"int8": 0.5, "int4": 0.9})
    for name, lg in (("int8", near), ("int4", far)):
        top1 = float((lg.argmax(-1) == ref.argmax(-1)).mean())
        kl = float(np.mean([entropy(softmax(a), softmax(b)) for a, b in zip(ref, lg)]))
        assert res[name]["top1"] == round(top1, 4) and res[name]["positions"] == 6
        assert abs(res[name]["mean_kl"] - kl) < 1e-5
    assert res["int8"]["mean_kl"] < res["int4"]["mean_kl"]
    assert res["int4"]["passed"] is (res["int4"]["top1"] >= 0.9)


def test_fp32_logits_are_computed_once_for_every_quality_pass(monkeypatch):
    """The build's quality passes share fp32's logits (FP32Logits): the same figures as passes that
    each run fp32 again, fp32 run once per text; a new set computes again, and a set over the
    byte cap is never held."""
    from dejavuu_build.build import quality as Q

    rng = np.random.default_rng(1)
    texts = [rng.standard_normal((5, 13)).astype(np.float32) for _ in range(3)]

    class Counted:
        calls = 0

        def __init__(self, tables):
            self.tables = iter(tables)

        def prefill(self, seq):
            Counted.calls += 1
            return _Fixed(next(self.tables)).prefill(seq)

    qs = QualitySet([np.arange(4)] * 3, [np.arange(5)] * 3, "t")
    other = [t + rng.standard_normal(t.shape).astype(np.float32) for t in texts]
    plain = gate_quality(Counted(texts), {"int4": Counted(other)}, qs, {})
    keep = Q.FP32Logits()
    Counted.calls = 0
    first = gate_quality(Counted(texts), {"int4": Counted(other)}, qs, {}, keep)
    second = gate_quality(Counted([]), {"int8": Counted(other)}, qs, {}, keep)  # fp32 never run again
    assert Counted.calls == 9 and first == plain and second["int8"] == plain["int4"]
    qs2 = QualitySet([np.arange(4)] * 3, [np.arange(5) + 1] * 3, "t2")  # another set: computed again
    Counted.calls = 0
    assert (
        gate_quality(Counted(texts), {"int4": Counted(other)}, qs2, {}, keep)["int4"]["top1"] == plain["int4"]["top1"]
    )
    assert Counted.calls == 6
    monkeypatch.setattr(Q, "FP32_LOGITS_BYTES", 100)  # too large to hold: fp32 runs in every pass
    small = Q.FP32Logits()
    gate_quality(Counted(texts), {"int4": Counted(other)}, qs, {}, small)
    Counted.calls = 0
    gate_quality(Counted(texts), {"int4": Counted(other)}, qs, {}, small)
    assert Counted.calls == 6


def test_every_quantized_variant_records_its_quality(tiny_llama):
    m = read_manifest(tiny_llama)
    q = {v: r.gates["quality"] for v, r in m.variants.items() if v != "fp32"}
    assert set(q) == {p + layout for p in ("fp32", "int8", "int4") for layout in ("", "-static", "-rowwise")} - {"fp32"}
    assert {g["positions"] for g in q.values()} == {len(TEXTS) * QUALITY_TOKENS}
    assert len({g["set_sha256"] for g in q.values()}) == 1  # one text set for all
    for v in ("fp32-static", "fp32-rowwise"):
        assert q[v]["top1"] >= 0.99 and q[v]["mean_kl"] < 1e-4
    assert q["int8"]["mean_kl"] < q["int4"]["mean_kl"]
    for v, g in q.items():
        assert m.variants[v].passed == (g["passed"] and all(x["passed"] for x in m.variants[v].gates.values()))


def test_bench_prints_the_variants_quality_next_to_its_speed(tiny_llama):
    from dejavuu_build.bench.report import Report, Row, add_quality, variant_quality

    PEER = "genai"

    def row(method):
        return Row("qa", method, 1, 1, 10, 100.0, 0.0, 1.0, 1.0, None, 1.0, 0.0, 1.0, 0.1, 100.0)

    report = Report([row("baseline"), row(PEER)], ("baseline", PEER), ("qa",))
    assert "top-1/KL" not in report.table()
    q = variant_quality(tiny_llama, "int4-static")
    assert q == read_manifest(tiny_llama).variants["int4-static"].gates["quality"]
    add_quality(report, q)
    ours, peer = report.rows
    assert (ours.top1_vs_fp32, ours.kl_vs_fp32) == (q["top1"], q["mean_kl"]) and peer.top1_vs_fp32 is None
    assert "top-1/KL vs fp32" in report.table() and f"{q['top1']:.3f}/{q['mean_kl']:.4f}" in report.table()
    assert variant_quality(tiny_llama, "int2") is None


def test_a_short_buffer_cuts_the_set_to_fit():
    qs = QualitySet([np.arange(100), np.arange(5)], [np.arange(64), np.arange(64)], "t")
    cut = qs.fit(80)
    assert [len(p) + len(c) - 1 for p, c in zip(cut.prompts, cut.continuations)] == [80, 68]
    assert cut.prompts[0][0] == 83 and cut.positions == 128 and "cut to 80" in cut.source
    tiny = qs.fit(40)
    assert all(len(p) + len(c) - 1 <= 40 for p, c in zip(tiny.prompts, tiny.continuations))
    assert qs.fit(1000) is qs
