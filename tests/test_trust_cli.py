"""Issue 25 (trust, round two), the CLI and the cache, through Click's CliRunner: quant-only never
blesses corrupt files, a manifest with the wrong types does not verify, and every expected
failure (bad corpus, wrong kind of entry, a full cache, empty options) is one line and exit 2."""

import errno
import json

from click.testing import CliRunner
from conftest import clone_entry

from dejavuu_build import cache
from dejavuu_build import schema as S
from dejavuu_build.cli import main


def _flip(path, at=None):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def one_line_error(r, *needles):
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert "Traceback" not in r.output and "unexpected" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    for n in needles:
        assert n in lines[0], (n, r.output)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---------------------------------------------------------------- point 1: quant-only launders nothing
def test_quant_only_refuses_an_entry_that_does_not_verify(tiny_llama):
    folder = clone_entry(tiny_llama, "launder")
    _flip(folder / "tokenizer.json", at=10)
    _flip(folder / S.variant_file("int8"))
    before = (folder / S.MANIFEST_FILE).read_bytes()
    one_line_error(
        invoke("quant-only", "--name", "launder", "--variants", "int4", "--no-timing"),
        "does not verify",
        "does not match its manifest sha256",
    )
    assert (folder / S.MANIFEST_FILE).read_bytes() == before
    one_line_error(invoke("verify", "launder"), "does not match")
    # an unlisted file is not carried in either
    folder = clone_entry(tiny_llama, "launder-unlisted")
    (folder / "extra.onnx").write_bytes(b"x")
    one_line_error(
        invoke("quant-only", "--name", "launder-unlisted", "--variants", "int4", "--no-timing"),
        "extra.onnx is not listed",
    )


def test_quant_only_still_repairs_the_variant_it_rebuilds(tiny_llama):
    folder = clone_entry(tiny_llama, "repair")
    _flip(folder / S.variant_file("int4"))
    one_line_error(invoke("verify", "repair"), "decoder_int4.onnx")
    r = invoke("quant-only", "--name", "repair", "--variants", "int4", "--no-timing")
    assert r.exit_code == 0, r.output
    assert invoke("verify", "repair").exit_code == 0


def test_quant_only_into_a_full_cache_is_one_line_and_keeps_the_entry(tiny_llama, monkeypatch):
    from dejavuu_build.build import pipeline

    folder = clone_entry(tiny_llama, "full-cache")
    before = (folder / S.MANIFEST_FILE).read_bytes()

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "link_or_copy", full)
    one_line_error(
        invoke("quant-only", "--name", "full-cache", "--variants", "int4", "--no-timing"),
        "No space left on device",
        "full-cache is unchanged",
    )
    assert (folder / S.MANIFEST_FILE).read_bytes() == before
    assert not (cache.cache_root() / S.STAGING_DIR / "full-cache").exists()
    cache.verify_entry(folder)


def test_quant_only_with_no_variants_is_refused():
    one_line_error(invoke("quant-only", "--name", "tiny-llama", "--variants", ""), "names no variant")
    one_line_error(invoke("quant-only", "--name", "tiny-llama", "--variants", " , "), "names no variant")


# ---------------------------------------------------------------- points 9, 10: the manifest's fields
def _edit(folder, fn):
    d = json.loads((folder / S.MANIFEST_FILE).read_text())
    fn(d)
    (folder / S.MANIFEST_FILE).write_text(json.dumps(d))


def test_a_default_variant_that_is_not_a_variant_does_not_verify(tiny_llama):
    for i, value in enumerate((["int4"], "int3", 4)):
        name = f"bad-default-{i}"
        folder = clone_entry(tiny_llama, name)
        _edit(folder, lambda d, value=value: d.update(default_variant=value))
        one_line_error(invoke("verify", name), "default_variant", "corrupted")
        one_line_error(invoke("generate", name, "abc", "--max-new-tokens", "2"), "default_variant")


def test_a_stray_symlink_is_reported_under_its_own_name(tiny_llama, tmp_path):
    folder = clone_entry(tiny_llama, "stray-link")
    (tmp_path / "elsewhere.onnx").write_bytes(b"x")
    (folder / "stray.onnx").symlink_to(tmp_path / "elsewhere.onnx")
    one_line_error(invoke("verify", "stray-link"), "stray.onnx is a symbolic link not listed in the manifest")


# ---------------------------------------------------------------- points 9, 10: datastores and their inputs
def test_a_bad_corpus_is_one_line_and_builds_nothing(tiny_llama, tmp_path):
    cases = {
        "broken.jsonl": (b'{"turns": ["abc abc"]}\n{"turns": [\n', "broken.jsonl:2: not JSON"),
        "latin1.jsonl": ('{"turns": ["caf\xe9"]}\n'.encode("latin-1"), "not UTF-8"),
        "latin1.txt": ("caf\xe9 au lait\n".encode("latin-1"), "not UTF-8"),
        "notext.jsonl": (b'{"id": 1}\n{"turns": ["   "]}\n', "holds no text"),
        "blank.txt": (b"\n\n   \n", "holds no text"),
    }
    for i, (fname, (data, needle)) in enumerate(cases.items()):
        (tmp_path / fname).write_bytes(data)
        one_line_error(
            invoke("datastore", "--from", tmp_path / fname, "--tokenizer", "tiny-llama", "--name", f"bad-ds-{i}"),
            needle,
        )
        assert not (cache.cache_root() / f"bad-ds-{i}").exists()


def test_a_datastore_into_a_full_cache_is_one_line(tiny_llama, tmp_path, monkeypatch):
    from dejavuu_build.runtime.drafters import datastore as ds_mod

    q = tmp_path / "q.jsonl"
    q.write_text('{"turns": ["abc abc abc"]}\n')

    def full(self, directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ds_mod.Datastore, "save", full)
    one_line_error(
        invoke("datastore", "--from", q, "--tokenizer", "tiny-llama", "--name", "ds-full"), "No space left on device"
    )
    assert not (cache.cache_root() / "ds-full").exists()


def test_a_decoder_given_as_a_datastore_is_one_line(tiny_llama):
    one_line_error(
        invoke(
            "generate", "tiny-llama", "abc", "--method", "rest", "--datastore", "tiny-llama", "--max-new-tokens", "2"
        ),
        "is a decoder build, not a datastore",
    )


def test_an_empty_variant_is_refused(tiny_llama):
    one_line_error(
        invoke("generate", "tiny-llama", "abc", "--variant", "", "--max-new-tokens", "2"), "variant must name"
    )


def test_a_missing_manifest_is_refused_by_generate_and_verify(tiny_llama):
    folder = clone_entry(tiny_llama, "lost-manifest")
    (folder / S.MANIFEST_FILE).unlink()
    for args in (
        ("generate", "lost-manifest", "abc", "--max-new-tokens", "2"),
        ("verify", "lost-manifest"),
        ("generate", folder / S.variant_file("fp32-rowwise"), "abc", "--max-new-tokens", "2"),
    ):
        one_line_error(invoke(*args), "has no manifest.json", "move that folder away")


def test_a_datastore_is_not_keyed_on_a_corrupt_tokenizer(tiny_llama, tmp_path):
    folder = clone_entry(tiny_llama, "bad-tokenizer")
    _flip(folder / "tokenizer.json", at=10)
    q = tmp_path / "q.jsonl"
    q.write_text('{"turns": ["abc abc abc"]}\n')
    one_line_error(
        invoke("datastore", "--from", q, "--tokenizer", "bad-tokenizer", "--name", "ds-bad-tok"),
        "tokenizer.json does not match",
    )
    assert not (cache.cache_root() / "ds-bad-tok").exists()
    (folder / S.MANIFEST_FILE).unlink()
    one_line_error(
        invoke("datastore", "--from", q, "--tokenizer", "bad-tokenizer", "--name", "ds-bad-tok"), "has no manifest.json"
    )
