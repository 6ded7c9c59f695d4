"""`dejavuu-build inspect --exactness`: the per-op table and the whole decoder's verdict, measured
on this machine, agree with what the build recorded; bad input is one line and exit 2."""

import json

from click.testing import CliRunner

from dejavuu_build import schema as S
from dejavuu_build.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_exactness_report_of_a_built_variant(tiny_llama):
    r = run("inspect", str(tiny_llama), "--exactness", "--variant", "int4", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    assert rec["variant"] == "int4" and rec["machine"]["onnxruntime"]
    verdicts = {p["signature"]: p["verdict"] for p in rec["probes"]}
    assert "Attention" in verdicts and any(s.startswith("MatMulNBits bits=4") for s in verdicts)
    assert "variant" not in verdicts.values()
    built = S.read_manifest(tiny_llama).variants["int4"].row_guard
    # what this run measures is what the build measured (same machine) and guarded
    assert sorted(s for s, v in verdicts.items() if v == "guardable") == built["guarded"]
    assert rec["graph_row_guard"]["length_invariant"] is True
    assert rec["model"]["passed"] and rec["model"]["logits_maxdiff"] == 0.0
    text = run("inspect", str(tiny_llama), "--exactness", "--variant", "int4-rowwise").output
    assert "whole decoder, a lone token as one row" in text and "EXACT on this machine" in text
    assert "row invariance per op" in text and "onnxruntime" in text


def test_exactness_bad_input_is_one_line(tiny_llama):
    r = CliRunner().invoke(main, ["inspect", str(tiny_llama), "--exactness", "--variant", "int9"])
    assert r.exit_code == 2 and "has no variant 'int9'" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["inspect", str(tiny_llama / "decoder_int4.onnx"), "--variant", "int4"])
    assert r.exit_code == 2 and "--variant goes with --exactness" in r.output
