"""`dejavuu-build inspect --quality`: a variant scored against the entry's fp32 on texts outside the
build's quality set; bad input is one line and exit 2."""

import json

from click.testing import CliRunner

from dejavuu_build.build.inspect_quality import held_out_texts
from dejavuu_build.build.quality import QUALITY_TOKENS
from dejavuu_build.build.quality_texts import TEXTS
from dejavuu_build.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_quality_on_held_out_texts(tiny_llama, tmp_path):
    texts = tmp_path / "mine.txt"
    texts.write_text("the cat sat on the mat\n\nabc abc abc abc\nprint(1 + 2)\n")
    # fp32-static runs the fp32 weights with another attention kernel: it agrees almost everywhere
    r = run("inspect", str(tiny_llama), "--quality", "--variant", "fp32-static", "--texts", str(texts), "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)["held_out"]
    assert rec["positions"] == 3 * QUALITY_TOKENS and rec["texts"] == 3
    assert rec["top1"] >= 0.99 and rec["mean_kl"] < 1e-4, rec
    # int4 against fp32 on two texts: a real measurement, worse than fp32-static's
    r = run("inspect", str(tiny_llama), "--quality", "--variant", "int4", "--texts", str(texts), "--limit", "2")
    assert r.exit_code == 0, r.output
    assert "int4: top-1" in r.output and f"/{2 * QUALITY_TOKENS})" in r.output and "the build's gate" in r.output


def test_spec_bench_rows_of_the_gates_set_are_left_out(tmp_path):
    """A Spec-Bench file (the default when it lies next to the checkout): the 32 prompts the gate
    scores never count as held out; the rest are spread evenly."""
    rows = [{"question_id": q, "category": c, "turns": [t]} for q, c, t in TEXTS]
    rows += [{"question_id": 1000 + i, "category": "qa", "turns": [f"held out question {i}?"]} for i in range(40)]
    f = tmp_path / "question.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows[::-1]) + "\n")
    texts, source = held_out_texts(f, 8)
    assert len(texts) == 8 and all(t.startswith("held out question") for t in texts), texts
    assert len(set(texts)) == 8 and "outside the gate's set (every 5th)" in source


def test_quality_bad_input_is_one_line(tiny_llama, tmp_path):
    for args, said in [
        (["--variant", "int9"], "pick a quantized variant"),
        (["--variant", "fp32"], "pick a quantized variant"),
        (["--texts", str(tmp_path / "none.txt")], "no such file"),
        (["--exactness"], "not both"),
    ]:
        r = run("inspect", str(tiny_llama), "--quality", *args)
        assert r.exit_code == 2 and said in r.output and "Traceback" not in r.output, (args, r.output)
    r = run("inspect", "no-such-entry", "--quality")
    assert r.exit_code == 2 and "no built entry" in r.output
