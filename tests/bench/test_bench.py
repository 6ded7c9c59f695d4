"""`dejavuu-build bench` on a tiny random decoder: outputs, the exactness gate, resume, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dejavuu_build.bench import BenchConfig, BenchError, ExactnessError, run_bench
from dejavuu_build.bench.config import default_data_path, read_prompts, select
from dejavuu_build.bench.runner import RECORDS_FILE
from dejavuu_build.machine import machine
from dejavuu_build.runtime.model import Model

# Two task prompts and two MT-Bench ones (categories writing/coding -> mt_bench, two turns each).
ROWS = [
    {"question_id": 1, "category": "qa", "turns": ["Q: what is the cat on? The cat sat on the mat. The cat sat on"]},
    {"question_id": 2, "category": "qa", "turns": ["Q: who is Ada? Ada wrote code. Ada wrote code for machines."]},
    {"question_id": 3, "category": "qa", "turns": ["Q: name a color. Red, green, blue, red, green, blue."]},
    {"question_id": 81, "category": "writing", "turns": ["Write a short poem about rain.", "Now make it rhyme."]},
    {"question_id": 121, "category": "coding", "turns": ["def add(a, b): return a + b. Explain.", "Add types."]},
    {"question_id": 82, "category": "writing", "turns": ["Write an email to Bob.", "Make it shorter."]},
]
CATS = ("qa", "mt_bench")


@pytest.fixture
def data(tmp_path) -> Path:
    p = tmp_path / "question.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def cfg_for(model: Path, data: Path, **kw) -> BenchConfig:
    kw = {"methods": ("pld",), "categories": CATS, "per_category": 2, "max_new_tokens": 16, "threads": 1, **kw}
    return BenchConfig(model=str(model), data=str(data), **kw)


class Calls(list):
    """Method names of Model.generate calls; ``probes``: those of the row-cost probe, kept apart."""

    probes: list[str]


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Record the method name of every Model.generate call."""
    seen: Calls = Calls()
    original = Model.generate

    def counting(self, prompt, settings=None, **kw):
        m = settings.method if settings is not None else kw.get("method", "baseline")
        name = m if isinstance(m, str) else m.name
        (probes if name == "row_probe" else seen).append(name)  # the row-cost probe (bench.oracle) apart
        return original(self, prompt, settings, **kw)

    seen.probes = probes = []

    monkeypatch.setattr(Model, "generate", counting)
    return seen


def test_end_to_end_writes_results_and_passes_gate(tiny_llama, data, tmp_path, calls):
    out = tmp_path / "run"
    report = run_bench(cfg_for(tiny_llama, data, methods=("pld", "rest")), out)
    for name in ("results.csv", "results.json", "speedup.png", RECORDS_FILE, "config.json"):
        assert (out / name).is_file(), name
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((out / "results.json").read_text())
    assert res["gate"]["passed"] and res["gate"]["generations"] == 3 * (2 + 4)
    assert res["prompts"] == {"qa": ["1", "2"], "mt_bench": ["81", "121"]}  # MT-Bench sources take turns
    assert {(r["category"], r["method"]) for r in res["rows"]} == {
        (c, m) for c in (*CATS, "overall") for m in ("baseline", "pld", "rest")
    }
    assert all(r["match_pct"] == 100.0 for r in res["rows"])
    assert report.row("overall", "baseline").speedup == pytest.approx(1.0)
    assert report.row("mt_bench", "pld").generations == 4 and report.row("mt_bench", "pld").prompts == 2
    assert "overall" in report.table()
    assert (out / "results.csv").read_text().splitlines()[0].startswith("category,method,prompts")
    # warm-up, then per prompt baseline first and the methods right after it; the row-cost probe
    # (1..8 rows, 3 rounds) before the prompts
    assert calls.probes == ["row_probe"] * 24
    assert calls[:4] == ["baseline", "baseline", "pld", "rest"]
    assert len(calls) == 1 + 3 * (2 + 4)
    # the copy oracle and each method's share of it, TTFT beside tok/s
    assert set(res["row_costs_ms"]) == {str(r) for r in range(1, 9)}
    qa = report.row("qa", "pld")
    assert qa.oracle_tokens_per_step >= 1.0 and qa.oracle_speedup > 0 and qa.ttft_ms > 0
    assert qa.slower is not None and report.row("qa", "baseline").slower is None
    assert res["never_slower"]["methods"] == []
    # where the timings were taken: this CPU's model and vector flags, the run's date and load
    assert {k: res["machine"][k] for k in machine()} == machine()
    assert {"date", "loadavg", "cpus", "arch"} <= set(res["machine"])


def test_gate_catches_a_changed_output(tiny_llama, data, tmp_path, monkeypatch):
    original = Model.generate

    def broken(self, prompt, settings=None, **kw):
        res = original(self, prompt, settings, **kw)
        if getattr(settings.method if settings else kw.get("method"), "name", None) == "pld":
            res.tokens = res.tokens[:-1] + [(res.tokens[-1] + 1) % 256]
        return res

    monkeypatch.setattr(Model, "generate", broken)
    out = tmp_path / "run"
    with pytest.raises(ExactnessError, match=r"pld: prompt \d+ .* first mismatch at token \d+") as e:
        run_bench(cfg_for(tiny_llama, data, per_category=1), out)
    assert e.value.report is not None and e.value.report.row("qa", "pld").match_pct < 100
    res = json.loads((out / "results.json").read_text())
    assert not res["gate"]["passed"]
    assert {m["method"] for m in res["gate"]["mismatches"]} == {"pld"}
    recs = [json.loads(line) for line in (out / RECORDS_FILE).read_text().splitlines()]
    assert {r["method"] for r in recs if not r["match"]} == {"pld"}


def test_resume_skips_finished_prompts(tiny_llama, data, tmp_path, calls):
    out = tmp_path / "run"
    run_bench(cfg_for(tiny_llama, data, per_category=1), out)
    assert len(calls) == 1 + 2 * (1 + 2)
    with pytest.raises(BenchError, match="--resume"):
        run_bench(cfg_for(tiny_llama, data, per_category=1), out)
    with pytest.raises(BenchError, match="max_new_tokens was 16"):
        run_bench(cfg_for(tiny_llama, data, per_category=2, max_new_tokens=8), out, resume=True)
    with pytest.raises(BenchError, match="skip was 0, now 1"):  # other prompts: not the same run
        run_bench(cfg_for(tiny_llama, data, per_category=2, skip=1), out, resume=True)
    # a run from before --skip (no skip in its config) resumes as skip 0
    conf = json.loads((out / "config.json").read_text())
    del conf["skip"]
    (out / "config.json").write_text(json.dumps(conf))
    with (out / RECORDS_FILE).open("a") as f:
        f.write('{"qid": "2", "turn": 1, "meth')  # a crash mid-write
    calls.clear()
    report = run_bench(cfg_for(tiny_llama, data, per_category=2), out, resume=True)
    assert len(calls) == 1 + 2 * (1 + 2)  # warm-up + only the two new prompts (qa 2, mt_bench 121)
    assert report.row("qa", "pld").prompts == 2 and report.row("mt_bench", "pld").prompts == 2
    calls.clear()
    run_bench(cfg_for(tiny_llama, data, per_category=2), out, resume=True)
    assert calls == []  # nothing left, not even a warm-up


def test_select_maps_and_interleaves_spec_bench():
    spec_bench = default_data_path()  # ../shared/data/spec_bench/question.jsonl next to the checkout
    if spec_bench is None:
        pytest.skip("Spec-Bench question.jsonl not present")
    prompts = read_prompts(spec_bench)
    mt = [p for p in prompts if p.category == "mt_bench"]
    assert len(mt) == 80 and all(len(p.turns) == 2 for p in mt)
    picked = select(prompts, ("mt_bench", "translation"), 8)
    assert len({p.source for p in picked if p.category == "mt_bench"}) == 8
    assert [p.qid for p in picked if p.category == "translation"] == [
        p.qid for p in prompts if p.category == "translation"
    ][:8]
    with pytest.raises(BenchError, match="no prompts for category nope"):
        select(prompts, ("nope",), 1)


def test_skip_selects_the_prompts_after_the_default_set_and_never_one_of_it():
    from dejavuu_build.bench.config import Prompt

    # two categories, the second with two source categories that take turns (as MT-Bench's do)
    prompts = [Prompt(f"t{i}", "translation", "translation", (f"text {i}" * (1 + i % 3),)) for i in range(30)]
    prompts += [Prompt(f"w{i}", "mt_bench", "writing", (f"w {i}",)) for i in range(15)]
    prompts += [Prompt(f"r{i}", "mt_bench", "roleplay", (f"r {i}",)) for i in range(15)]
    cats = ("translation", "mt_bench")
    first = select(prompts, cats, 10)
    held = select(prompts, cats, 10, skip=10)
    assert len(held) == 20 and not {p.qid for p in first} & {p.qid for p in held}
    assert [p.qid for p in held if p.category == "translation"] == [f"t{i}" for i in range(10, 20)]
    # mt_bench's own order interleaves its sources; the skip continues that order
    assert [p.qid for p in held if p.category == "mt_bench"] == [
        "w5",
        "r5",
        "w6",
        "r6",
        "w7",
        "r7",
        "w8",
        "r8",
        "w9",
        "r9",
    ]
    # the fits filter counts before the skip: the prompts left out are fitting ones
    fits = lambda p: len(p.turns[0]) < 10  # noqa: E731  (every third translation prompt is short)
    short = select(prompts, ("translation",), 3, fits=fits, skip=2)
    assert [p.qid for p in short] == [p.qid for p in select(prompts, ("translation",), 5, fits=fits)][2:]
    assert [p.qid for p in short] == ["t6", "t9", "t12"]
    with pytest.raises(BenchError, match="--skip"):
        BenchConfig(model="m", skip=-1)


def _cli():
    from dejavuu_build.bench.cli import bench
    from dejavuu_build.cli import main

    if "bench" not in main.commands:
        main.add_command(bench)
    return main


def test_cli(tiny_llama, data, tmp_path):
    out = tmp_path / "cli-run"
    args = [
        "bench",
        "--model",
        str(tiny_llama),
        "--data",
        str(data),
        "--categories",
        ",".join(CATS),
        "--per-category",
        "1",
        "--max-new-tokens",
        "8",
        "--methods",
        "pld",
        "--threads",
        "1",
    ]
    r = CliRunner().invoke(_cli(), [*args, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "overall" in r.output and (out / "speedup.png").is_file()
    r = CliRunner().invoke(_cli(), [*args, "--resume", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(_cli(), [*args, "--out", str(out)])
    assert r.exit_code == 2 and "error:" in r.output and "--resume" in r.output
    r = CliRunner().invoke(_cli(), ["bench", "--model", str(tiny_llama), "--data", str(tmp_path / "missing.jsonl")])
    assert r.exit_code == 2 and "hemingkx/Spec-Bench" in r.output
    r = CliRunner().invoke(_cli(), [*args[:-6], "--methods", "nope", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "unknown method" in r.output


def test_raw_one_row_baseline_is_timed_not_gated(tiny_llama, tmp_path):
    """baseline_n1 (ORT's one-row path, unpadded) is reported beside the gated methods."""
    import json as _json

    from dejavuu_build.bench.config import BenchConfig, default_data_path
    from dejavuu_build.bench.runner import run_bench

    if default_data_path() is None:
        pytest.skip("Spec-Bench question.jsonl not present")
    cfg = BenchConfig(
        model=str(tiny_llama),
        methods=("baseline", "baseline_n1", "pld"),
        categories=("qa",),
        per_category=1,
        max_new_tokens=8,
        data=str(default_data_path()),
    )
    run_bench(cfg, tmp_path / "out")
    recs = [_json.loads(line) for line in open(tmp_path / "out" / "records.jsonl")]
    raw = [r for r in recs if r["method"] == "baseline_n1"]
    assert raw and all(r["gated"] is False for r in raw)
    assert all(r["gated"] for r in recs if r["method"] != "baseline_n1")


@pytest.mark.parametrize("variant,pad", [("int4-rowwise", False), ("int4-static", False), ("int4-static", True)])
def test_methods_decode_as_generate_does(tiny_llama, data, tmp_path, monkeypatch, variant, pad):
    """The bench never changes how a method decodes: each runs with the decoder's own pad-row
    setting (a length-invariant decoder has none, so no pad-row fill and a lone token costs one
    row, as a user's `generate` gets); only the raw reference baseline_n1 drops a padded decoder's
    pad row. (It once forced the pad row on every method, so rowwise runs were timed with the
    fill.) ``pad``: the static decoder as a graph built before its attention floor loads (the
    runtime pads its lone tokens)."""
    seen: list[bool] = []
    original = Model.generate
    if pad:
        from dejavuu_build.runtime.decoder import Decoder

        init = Decoder.__init__

        def padded(self, *a, **kw):
            init(self, *a, **kw)
            self.pad_single = True

        monkeypatch.setattr(Decoder, "__init__", padded)

    def spy(self, prompt, settings=None, **kw):
        method = settings.method if settings else kw.get("method")
        if getattr(method, "name", None) != "row_probe":  # bench.oracle's row-cost probe
            seen.append(self.decoder.pad_single)
        return original(self, prompt, settings, **kw)

    monkeypatch.setattr(Model, "generate", spy)
    run_bench(
        cfg_for(tiny_llama, data, methods=("baseline_n1", "pld"), categories=("qa",), per_category=1, variant=variant),
        tmp_path / "run",
    )
    assert seen[1:] == [pad, False, pad]  # after the warm-up: baseline, baseline_n1, pld
