"""genai's peer on sliding-window models (its KV buffers hold at least the window), and a peer that
cannot run: one line, the bench goes on without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dejavuu_build.bench import genai as G

GEMMA = {"context_length": 32768, "decoder": {"sliding_window": {"window_size": 512, "cache_slack": 0, "layers": [0]}}}


def test_kv_capacity_holds_the_window_and_the_generation():
    assert G.kv_capacity(GEMMA, 72) == 512  # Gemma-3's window under a 72-position generation
    assert G.kv_capacity(GEMMA, 600) == 600
    slack = json.loads(json.dumps(GEMMA))
    slack["decoder"]["sliding_window"]["cache_slack"] = 16
    assert G.kv_capacity(slack, 72) == 528
    assert (
        G.kv_capacity({"context_length": 300, **{k: v for k, v in GEMMA.items() if k != "context_length"}}, 72) == 300
    )
    assert G.kv_capacity({"decoder": {}}, 72) == 72  # no window: the generation's own length, as before
    assert G.kv_capacity({"decoder": {"sliding_window": None}}, 9) == 9


def _cli():
    from dejavuu_build.bench.cli import bench
    from dejavuu_build.cli import main

    if "bench" not in main.commands:
        main.add_command(bench)
    return main


ROWS = [
    {"question_id": 1, "category": "qa", "turns": ["Q: what is the cat on? The cat sat on the mat. The cat sat on"]},
    {"question_id": 2, "category": "qa", "turns": ["The dog ran in the park. The dog ran in the park. The dog"]},
]


@pytest.mark.parametrize("where", ["build", "generate"])
def test_a_peer_that_cannot_run_is_one_line_and_the_bench_goes_on(tiny_llama, tmp_path, monkeypatch, caplog, where):
    pytest.importorskip("onnxruntime_genai")
    if where == "build":

        def boom(*a, **k):
            raise RuntimeError("the builder has no recipe for this architecture\nsecond line")

        monkeypatch.setattr(G, "ensure_genai_model", boom)
    else:  # what Gemma-3 did before its KV capacity covered the window: the generator refuses
        monkeypatch.setattr(G, "ensure_genai_model", lambda *a, **k: Path("peer"))

        class Refusing:
            name = G.GENAI

            def __init__(self, *a, **k):
                pass

            def preflight(self):
                msg = (
                    "Non-zero status code returned while running GroupQueryAttention node. Name:'/model/layers.0/"
                    "attn/GroupQueryAttention' Status Message: sliding_window_cache: KV cache capacity (10) must "
                    "be at least local_window_size (512)."
                )
                raise G.BenchError(f"onnxruntime-genai's generator failed on peer: {G._one_line(RuntimeError(msg))}")

        monkeypatch.setattr(G, "GenaiPeer", Refusing)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    r = CliRunner().invoke(
        _cli(),
        [
            "bench",
            "--model",
            str(tiny_llama),
            "--compare",
            "genai",
            "--methods",
            "baseline,pld",
            "--categories",
            "qa",
            "--per-category",
            "1",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            "--data",
            str(data),
            "--out",
            str(out),
        ],  # fmt: skip
    )
    assert r.exit_code == 0, r.output
    assert "unexpected" not in r.output
    # the CLI's log handler or pytest's takes it, depending on which configured the logger first
    said = [ln.strip() for ln in r.output.splitlines() if "genai peer skipped" in ln]
    said += [x.getMessage() for x in caplog.records if "genai peer skipped" in x.getMessage()]
    assert len(set(said)) == 1 and len(said) <= 2, r.output
    assert ("no recipe for this architecture" if where == "build" else "KV cache capacity (10)") in said[0]
    assert "\n" not in said[0] and "Non-zero status" not in said[0]  # one line: onnxruntime's own message
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert {x["method"] for x in recs} == {"baseline", "pld"}  # ours ran, no peer rows
    res = json.loads((out / "results.json").read_text())
    assert res["gate"]["passed"]


def test_genai_runs_a_sliding_window_model_below_its_window(cache_dir):
    """The tiny Gemma-3 (window 8) through genai's own builder and generator: a generation shorter
    than the window runs (genai's KV capacity was the generation's length, below the window its
    kernel needs), and the plain-onnxruntime replay of its graph agrees with it."""
    pytest.importorskip("onnxruntime_genai")
    from conftest import build_tiny

    from dejavuu_build.schema import read_manifest

    folder = G.ensure_genai_model(read_manifest(build_tiny("gemma3", cache_dir)))
    cfg = json.loads((folder / "genai_config.json").read_text())["model"]
    window = cfg["decoder"].get("sliding_window")
    if not window:
        pytest.skip(f"genai {G.require_genai().__version__} builds this Gemma without a windowed cache")
    peer, why = G.load_genai_peer(read_manifest(build_tiny("gemma3", cache_dir)), 1)
    assert peer is not None, why
    ids = [5, 17, 42]
    assert len(ids) + 3 < window["window_size"]
    res = peer.generate(ids, 3, ignore_eos=True)
    assert len(res.tokens) == 3 and res.steps == 2
    logits = G.GenaiReplay(folder, 1).logits(ids + res.tokens[:-1])
    assert list(logits[len(ids) - 1 :].argmax(-1)) == res.tokens
    assert "window" in peer.describe()["search"] and peer.describe()["kv_min_capacity"] >= window["window_size"]
