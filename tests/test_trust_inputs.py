"""Issue 35 (trust, round three), points 8 and 9: every input a careless user or a hostile file
gives is one clear line and exit 2 -- never "unexpected ..." or a traceback: JSONL lines nested
100k deep, lone surrogates, binary files, an output that cannot be written, a full or read-only
cache, a stop that is no string, and empty options that would otherwise mean something else."""

import errno
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dejavuu_build import cache
from dejavuu_build.cli import main
from dejavuu_build.errors import GenerationError


def one_line_error(r, *needles):
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert "Traceback" not in r.output and "unexpected" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), r.output
    assert not any(ln.startswith("error: ") for ln in lines[:-1]), r.output
    for n in needles:
        assert n in lines[-1], (n, r.output)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


DEEP = '{"question_id": 1, "category": "writing", "turns": [' + "[" * 100_000 + "]" * 100_000 + "]}\n"
SURROGATE = '{"question_id": 1, "category": "writing", "turns": ["abc \\ud800 abc abc"]}\n'
BINARY = bytes(range(256)) * 8


@pytest.fixture()
def files(tmp_path):
    out = {}
    for name, data in (("deep.jsonl", DEEP), ("surrogate.jsonl", SURROGATE)):
        (tmp_path / name).write_text(data)
        out[name] = tmp_path / name
    for name in ("binary.jsonl", "binary.txt"):
        (tmp_path / name).write_bytes(BINARY)
        out[name] = tmp_path / name
    return out


CASES = {
    "deep.jsonl": "nested too deeply",
    "surrogate.jsonl": "lone surrogate (\\ud800)",
    "binary.jsonl": "is not UTF-8 text",
    "binary.txt": "is not UTF-8 text",
}


@pytest.mark.parametrize("fname", sorted(CASES))
def test_a_hostile_corpus_is_one_line_for_datastore(tiny_llama, files, fname):
    name = f"hostile-ds-{fname.replace('.', '-')}"
    one_line_error(
        invoke("datastore", "--from", files[fname], "--tokenizer", "tiny-llama", "--name", name), CASES[fname]
    )
    assert not (cache.cache_root() / name).exists()


@pytest.mark.parametrize("fname", sorted(CASES))
def test_a_hostile_text_file_is_one_line_for_inspect_quality(tiny_llama, files, fname):
    one_line_error(invoke("inspect", "tiny-llama", "--quality", "--texts", files[fname], "--limit", "1"), CASES[fname])


@pytest.mark.parametrize("fname", sorted(CASES))
def test_a_hostile_data_file_is_one_line_for_bench(tiny_llama, files, fname, tmp_path):
    one_line_error(
        invoke("bench", "--model", "tiny-llama", "--data", files[fname], "--out", tmp_path / "out"), CASES[fname]
    )


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
@pytest.mark.parametrize("stream", [False, True])
def test_generate_into_a_full_device_is_one_line(tiny_llama, cache_dir, stream):
    with open("/dev/full", "w") as full:
        out = subprocess.run(
            [sys.executable, "-m", "dejavuu_build.cli", "generate", str(tiny_llama), "abc", "--max-new-tokens", "4"]
            + ["--stream"] * stream,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            env=dict(os.environ, DEJAVUU_CACHE=str(cache_dir)),
        )
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert err and err[-1].startswith("error: No space left on device: the output (stdout) could not be written"), (
        out.stderr[-2000:]
    )
    assert "unexpected" not in out.stderr and "Traceback" not in out.stderr and "Exception ignored" not in out.stderr


def _tiny_source(tmp_path):
    from tiny import save_tiny

    return save_tiny("llama", tmp_path / "src")


@pytest.mark.parametrize(
    "code,needle", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")]
)
def test_tree_decoder_into_a_full_or_read_only_cache_is_one_line(tmp_path, cache_dir, monkeypatch, code, needle):
    from dejavuu_build.build import pipeline

    src = _tiny_source(tmp_path)
    where = str(cache.cache_root() / ".locks")

    def fails(*a, **k):
        raise OSError(code, os.strerror(code), where)

    monkeypatch.setattr(pipeline, "build_lock", fails)
    name = f"no-room-{code}"
    one_line_error(invoke("tree-decoder", "--model", src, "--name", name, "--no-timing"), needle, where)
    assert not (cache.cache_root() / name).exists()


def test_generate_with_a_stop_that_is_no_string_is_a_typed_error(tiny_llama):
    from dejavuu_build.runtime import load

    m = load(tiny_llama)
    for bad in (5, 2.5, object(), b"ab", {"a": 1}):
        with pytest.raises(GenerationError, match="stop must be a string or a list of strings"):
            m.generate("abc", max_new_tokens=2, stop=bad)
        with pytest.raises(GenerationError, match="stop must be a string or a list of strings"):
            list(m.stream("abc", max_new_tokens=2, stop=bad))
    with pytest.raises(GenerationError, match="stop strings must be non-empty text"):
        m.generate("abc", max_new_tokens=2, stop=[5])
    assert m.generate("abc", max_new_tokens=2, stop=None).tokens == m.generate("abc", max_new_tokens=2).tokens


# ---------------------------------------------------------------- point 9: empty strings that would mean something else
def test_an_empty_model_is_refused_not_read_as_the_default(monkeypatch, cache_dir):
    from dejavuu_build.build import sources

    resolved = []
    monkeypatch.setattr(sources, "resolve", lambda *a, **k: resolved.append(a) or 1 / 0)
    for empty in ("", "  "):
        one_line_error(invoke("tree-decoder", "--model", empty, "--dry-run"), "names no model")
        one_line_error(invoke("vlm", "--model", empty), "names no model")
    assert resolved == []  # nothing was fetched (the default comes from PyPI)


def test_empty_variants_are_refused_not_read_as_auto(cache_dir):
    for empty in ("", " , "):
        one_line_error(invoke("tree-decoder", "--model", "x/y", "--variants", empty, "--dry-run"), "names no variant")
        one_line_error(invoke("vlm", "--model", "x/y", "--variants", empty), "names no variant")
    r = invoke("tree-decoder", "--model", "x/y", "--variants", "auto", "--dry-run")
    assert r.exit_code == 0 and '"variants": []' in r.output, r.output


def test_inspect_of_a_datastore_says_it_is_one(tiny_llama, tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text('{"turns": ["abc abc abc"]}\n')
    assert invoke("datastore", "--from", q, "--tokenizer", "tiny-llama", "--name", "inspect-ds").exit_code == 0
    for flag in ("--exactness", "--quality"):
        one_line_error(invoke("inspect", "inspect-ds", flag), "is a datastore entry, not a decoder build")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_request_temperature_that_is_no_number_says_so(field, value):
    """A server request's NaN / Infinity is refused as not finite, not as "should be <= 2"."""
    pytest.importorskip("fastapi")
    import pydantic

    from dejavuu_build.serve.app import ChatBody, CompletionBody

    for body, extra in (
        (ChatBody, '"messages": [{"role": "user", "content": "hi"}]'),
        (CompletionBody, '"prompt": "hi"'),
    ):
        with pytest.raises(pydantic.ValidationError) as e:
            body.model_validate_json(f'{{"model": "m", {extra}, "{field}": {value}}}')
        msgs = [err["msg"] for err in e.value.errors()]
        assert msgs == ["Input should be a finite number"], msgs
