"""Loading: torch-free runtime, default variant, integrity, third-party (optimum) decoders, errors."""

import json
import os
import subprocess
import sys

import pytest
from conftest import build_tiny, clone_entry

from dejavuu_build import schema as S
from dejavuu_build.errors import CacheError, IntegrityError
from dejavuu_build.runtime import load


def test_runtime_never_imports_torch(tiny_llama, cache_dir):
    code = (
        "import sys\n"
        "from dejavuu_build.runtime import load\n"
        f"m = load({str(tiny_llama)!r})\n"
        "r = m.generate('abcabcabc', method='pld', tree=True, max_new_tokens=12)\n"
        "r = m.generate([{'role': 'user', 'content': 'hi'}], method='suffix_decoding', max_new_tokens=5)\n"
        "assert r.stats.tokens >= 1\n"
        "bad = [k for k in sys.modules if k == 'torch' or k.startswith(('torch.', 'transformers', 'onnx.'))]\n"
        "print('IMPORTED', bad)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, DEJAVUU_CACHE=str(cache_dir)),
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert "IMPORTED []" in out.stdout


def test_default_variant_and_names(tiny_llama):
    m = load(tiny_llama)
    man = S.read_manifest(tiny_llama)
    assert m.variant == man.default_variant and man.variants[m.variant].passed
    # untimed build: the preferred candidate (smallest precision, then layouts.PREFERRED_LAYOUTS), as timed ones start
    assert man.default_variant == man.default_reason["preferred"] == "int4-static"
    assert load(tiny_llama.name).folder == tiny_llama  # by cache name
    assert load(tiny_llama / S.variant_file("int8")).variant == "int8"  # by .onnx path


def test_drift_and_missing_artifacts_are_clear(cache_dir):
    folder = build_tiny("llama", cache_dir, name="drift-llama", variants=("fp32", "int4"))
    with pytest.raises(CacheError, match="quant-only"):
        load(folder, variant="int8")
    with pytest.raises(CacheError, match="tree-decoder --name nothing-here"):
        load("nothing-here")
    f = folder / S.variant_file("int4")
    f.write_bytes(f.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(
        IntegrityError,
        match=r"decoder_int4\.onnx.*rebuild it with `dejavuu-build tree-decoder --name drift-llama --force`",
    ):
        load(folder, variant="int4")
    assert load(folder, variant="fp32").variant == "fp32"  # the other files are fine


def test_contract_mismatch_is_refused(cache_dir):
    folder = build_tiny("llama", cache_dir, name="contract-llama", variants=("fp32",))
    c = json.loads((folder / S.CONTRACT_FILE).read_text())
    c["num_layers"] = 3
    (folder / S.CONTRACT_FILE).write_text(json.dumps(c))
    with pytest.raises(Exception, match="contract"):
        load(folder, verify=False)


def test_optimum_export_runs_in_chain_mode(tmp_path, caplog):
    """A stock optimum-onnx causal-LM export (2D mask, no hidden states) runs; tree mode warns once."""
    pytest.importorskip(
        "optimum.exporters.onnx",
        reason="optimum-onnx is not installed (the `optimum` extra; it requires transformers < 4.58)",
    )
    from optimum.exporters.onnx import main_export
    from tiny import save_tiny

    src = save_tiny("llama", tmp_path / "src")
    out = tmp_path / "optimum"
    main_export(str(src), output=str(out), task="text-generation-with-past", no_post_process=True, do_validation=False)
    m = load(out / "model.onnx")
    assert m.contract.mask_kind == "padding_2d" and not m.tree_capable
    base = m.generate("abcabcabcabc", max_new_tokens=20)
    import logging

    with caplog.at_level(logging.WARNING, logger="dejavuu"):
        r1 = m.generate("abcabcabcabc", method="pld", tree=True, max_new_tokens=20)
        r2 = m.generate("abcabcabcabc", method="suffix_decoding", tree=True, max_new_tokens=20)
    assert r1.tokens == base.tokens == r2.tokens
    assert r1.stats.accepted > 0 and not r1.tree
    assert sum("tree mode is off" in rec.message for rec in caplog.records) == 1
    # Same weights as our export: same greedy tokens.
    ours = load(build_tiny_for(src, tmp_path))
    assert ours.generate("abcabcabcabc", max_new_tokens=20).tokens == base.tokens


def build_tiny_for(src, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    from dejavuu_build.export.exporter import export_decoder
    from dejavuu_build.recipes import registered

    d = tmp_path / "ours"
    d.mkdir()
    export_decoder(AutoModelForCausalLM.from_pretrained(src).eval(), registered()["llama"](), d / "decoder.onnx")
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / f, d / f)
    return d / "decoder.onnx"


# ---------------------------------------------------------------- item 4: load exactly what was named
def test_an_onnx_file_outside_the_manifest_is_refused(tiny_llama):
    import shutil

    folder = clone_entry(tiny_llama, "evil-file")
    shutil.copy(folder / S.variant_file("fp32"), folder / "evil.onnx")
    with pytest.raises(CacheError, match="evil.onnx is not one of"):
        load(folder / "evil.onnx", verify=False)
    (folder / "evil.onnx").unlink()
    with pytest.raises(CacheError, match="decoder_int4.onnx is the int4 variant, not fp32"):
        load(folder / S.variant_file("int4"), variant="fp32")
    assert load(folder / S.variant_file("int4")).variant == "int4"


def test_a_cache_name_is_not_shadowed_by_a_folder_here(tiny_llama, tmp_path, monkeypatch):
    import shutil

    here = tmp_path / "cwd"
    shutil.copytree(tiny_llama, here / tiny_llama.name)  # a same-named folder in the current directory
    (here / tiny_llama.name / S.variant_file("int4")).write_bytes(b"not a model")
    monkeypatch.chdir(here)
    m = load(tiny_llama.name, variant="int4")
    assert m.folder == tiny_llama  # the cache entry, not ./tiny-llama
    with pytest.raises(IntegrityError):  # ./name is the folder, as written
        load(f"./{tiny_llama.name}", variant="int4")


def test_threads_are_bounded_by_the_cpu_count(tiny_llama):
    from dejavuu_build.errors import DejavuuError

    for bad in (0, -1, (os.cpu_count() or 1) + 1, 10_000):
        with pytest.raises(DejavuuError, match="threads"):
            load(tiny_llama, threads=bad)
