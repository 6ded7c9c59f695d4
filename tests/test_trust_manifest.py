"""Issue 35 (trust, round three), points 3 and 6: every path a manifest names (files, the serving
batch graph, the provenance view) stays inside its entry and is hashed like every other file;
`verify` checks what `load` and `serve` open, so a ✓ means they work; what they cannot read (an
unknown schema version, a failing default, a batched record of the wrong type or graph, a broken
tokenizer) is one line and exit 2 for verify and for generate alike."""

import hashlib
import json

import pytest
from conftest import clone_entry
from test_trust_cli import invoke, one_line_error

from dejavuu_build import cache
from dejavuu_build import schema as S
from dejavuu_build.errors import CacheError, IntegrityError


def _edit(folder, fn):
    d = json.loads((folder / S.MANIFEST_FILE).read_text())
    fn(d)
    (folder / S.MANIFEST_FILE).write_text(json.dumps(d))


def _rehash(folder, rel):
    """What a careful tamperer does: the file's new sha256 and size written into the manifest."""
    data = (folder / rel).read_bytes()

    def fix(d):
        d["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

    _edit(folder, fix)


def _both_refuse(name, *needles):
    one_line_error(invoke("verify", name), *needles)
    one_line_error(invoke("generate", name, "abc", "--max-new-tokens", "2"), *needles)


@pytest.fixture(scope="module")
def other(tiny_llama):
    """Another entry beside the one a test damages (its batched graph is what an escape reaches)."""
    return clone_entry(tiny_llama, "trust3-other")


# ---------------------------------------------------------------- point 3: no path leaves the entry
@pytest.mark.parametrize(
    "bad", ["../trust3-other/decoder_int4-static.batched.onnx", "../../../../../../etc/passwd", "/etc/passwd"]
)
def test_a_batched_graph_outside_the_entry_is_refused(tiny_llama, other, bad):
    folder = clone_entry(tiny_llama, "batched-escape")
    _edit(folder, lambda d: d["batched"].update(file=bad))
    _both_refuse("batched-escape", "outside the entry")
    with pytest.raises(IntegrityError, match="outside the entry"):
        cache.verify_entry(folder, [])  # what the server's open_batch checks before it opens the file


def test_a_batched_graph_is_hashed_and_matches_its_record(tiny_llama):
    folder = clone_entry(tiny_llama, "batched-sha")
    rel = json.loads((folder / S.MANIFEST_FILE).read_text())["batched"]["file"]
    _edit(folder, lambda d: d["batched"].update(sha256="0" * 64))
    one_line_error(invoke("verify", "batched-sha"), "batched graph record", "another sha256")
    with pytest.raises(IntegrityError, match="another sha256"):
        cache.verify_entry(folder, [rel])
    # listed nowhere in files: no sha256 would be checked, so it is refused
    folder = clone_entry(tiny_llama, "batched-unlisted")
    _edit(folder, lambda d: d["files"].pop(rel))
    one_line_error(invoke("verify", "batched-unlisted"), "not listed")


@pytest.mark.parametrize(
    "where,value",
    [
        ("variants", "../trust3-other/decoder_int4.onnx"),
        ("variants", "/etc/passwd"),
        ("variants", S.variant_file("fp32")),  # inside, but another variant's file
        ("graphs", "../trust3-other/decoder_int4.onnx"),
    ],
)
def test_the_provenance_view_names_only_the_entrys_own_files(tiny_llama, other, where, value):
    folder = clone_entry(tiny_llama, "provenance-escape")

    def point(d):
        if where == "variants":
            d["provenance"]["variants"]["int4"]["file"] = value
        else:
            d["provenance"]["graphs"] = {"decoder": {"int4": value}}

    _edit(folder, point)
    one_line_error(invoke("verify", "provenance-escape"), "provenance")


# ---------------------------------------------------------------- point 6: verify checks what load and serve open
@pytest.mark.parametrize("value", [None, "decoder_int4-static.batched.onnx", 5, ["x"]])
def test_a_batched_record_of_the_wrong_type_is_one_line(tiny_llama, value):
    folder = clone_entry(tiny_llama, "batched-type")
    _edit(folder, lambda d: d.update(batched=value))
    _both_refuse("batched-type", "batched", "corrupted")


@pytest.mark.parametrize("plain_variant", ["int4", "int4-rowwise"])
def test_a_batched_record_naming_a_graph_that_is_not_batched_does_not_verify(tiny_llama, plain_variant):
    """A plain graph recorded as the batched one: the concat one takes none of the batch inputs;
    the plain rowwise one takes the same names as its batched flavour, but no batch dimension."""
    folder = clone_entry(tiny_llama, "batched-plain")
    plain = S.variant_file(plain_variant)

    def point(d):
        d["batched"].update(file=plain, sha256=d["files"][plain]["sha256"], bytes=d["files"][plain]["bytes"])

    _edit(folder, point)
    one_line_error(invoke("verify", "batched-plain"), "recorded as the serving batch graph but is not one")


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2, 3]", b'{"model": 5}'])
def test_a_broken_tokenizer_rehashed_into_the_manifest_is_one_line(tiny_llama, content):
    folder = clone_entry(tiny_llama, "broken-tokenizer")
    (folder / S.TOKENIZER_FILE).write_bytes(content)
    _rehash(folder, S.TOKENIZER_FILE)
    _both_refuse("broken-tokenizer", "tokenizer.json cannot be read")


def test_a_broken_tokenizer_config_rehashed_into_the_manifest_is_one_line(tiny_llama):
    folder = clone_entry(tiny_llama, "broken-tokenizer-config")
    (folder / S.TOKENIZER_CONFIG_FILE).write_bytes(b"[1]")
    _rehash(folder, S.TOKENIZER_CONFIG_FILE)
    _both_refuse("broken-tokenizer-config", "tokenizer_config.json cannot be read")


@pytest.mark.parametrize("version", [999, 0, "2", None])
def test_an_unknown_manifest_schema_version_is_refused_by_name(tiny_llama, version):
    folder = clone_entry(tiny_llama, "future-manifest")
    _edit(folder, lambda d: d.update(schema_version=version))
    _both_refuse("future-manifest", f"schema_version {version!r}")


def test_an_unknown_contract_schema_version_is_refused_by_name(tiny_llama):
    folder = clone_entry(tiny_llama, "future-contract")
    c = json.loads((folder / S.CONTRACT_FILE).read_text())
    c["schema_version"] = 999
    (folder / S.CONTRACT_FILE).write_text(json.dumps(c))
    _rehash(folder, S.CONTRACT_FILE)
    _both_refuse("future-contract", "contract.json has schema_version 999")


def test_a_default_recorded_as_failing_is_refused(tiny_llama):
    folder = clone_entry(tiny_llama, "failing-default")
    _edit(folder, lambda d: d["variants"][d["default_variant"]].update(passed=False))
    _both_refuse("failing-default", "default_variant", "failing its gates")
    with pytest.raises(CacheError, match="failing its gates"):
        cache.read_checked_manifest(folder)


def test_what_held_still_holds(tiny_llama):
    folder = clone_entry(tiny_llama, "trust3-intact")
    r = invoke("verify", "trust3-intact")
    assert r.exit_code == 0 and r.output.startswith("✓"), r.output
    assert invoke("generate", "trust3-intact", "abc", "--max-new-tokens", "2").exit_code == 0
    cache.verify_entry(folder)


# ---------------------------------------------------------------- point 9: the name a hint suggests
def test_a_hint_never_suggests_a_name_that_is_not_one(tiny_llama, monkeypatch):
    folder = clone_entry(tiny_llama, "hint-name")
    (folder / "sub").mkdir()
    data = bytearray((folder / S.TOKENIZER_FILE).read_bytes())
    data[10] ^= 1
    (folder / S.TOKENIZER_FILE).write_bytes(bytes(data))
    monkeypatch.chdir(folder / "sub")
    r = invoke("verify", "..")
    one_line_error(r, "--name hint-name")
    assert "--name .." not in r.output


def test_the_server_refuses_a_batched_record_naming_a_graph_that_is_not_batched(tiny_llama):
    """What serve opens at start-up: one IntegrityError (one line, exit 2), not onnxruntime's
    "Failed to find NodeArg" from the first batch."""
    from dejavuu_build.runtime import load
    from dejavuu_build.serve.batch import open_batch

    folder = clone_entry(tiny_llama, "batched-plain-serve")
    plain = S.variant_file("int4")

    def point(d):
        d["batched"].update(file=plain, sha256=d["files"][plain]["sha256"], bytes=d["files"][plain]["bytes"])

    _edit(folder, point)
    variant = json.loads((folder / S.MANIFEST_FILE).read_text())["batched"]["variant"]
    model = load(folder, variant=variant)
    with pytest.raises(IntegrityError, match="recorded as the serving batch graph but is not one"):
        open_batch(model, 2)
