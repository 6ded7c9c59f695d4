"""Cache: atomic writes, locking, cache hits, tamper detection."""

import os
import threading

import pytest

from dejavuu_build import cache, schema as S
from dejavuu_build.build.config import TreeDecoderConfig
from dejavuu_build.build import pipeline
from dejavuu_build.errors import CacheError, IntegrityError

from conftest import build_tiny


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DEJAVUU_CACHE", str(tmp_path / "a"))
    assert cache.cache_root() == tmp_path / "a"
    monkeypatch.delenv("DEJAVUU_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache.cache_root() == tmp_path / "x" / "dejavuu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_root() == cache.Path.home() / ".cache" / "dejavuu"


def test_interrupted_build_leaves_nothing_and_keeps_previous(cache_dir, monkeypatch):
    folder = build_tiny("llama", cache_dir, name="atomic-llama", variants=("fp32", "int4"))
    before = S.read_manifest(folder)
    src = before.source["path"]

    def boom(*a, **k):
        raise KeyboardInterrupt  # as if the user pressed ^C during quantization

    monkeypatch.setattr("dejavuu_build.quantize.quantize_model", boom)
    with pytest.raises(KeyboardInterrupt):
        pipeline.build_tree_decoder(TreeDecoderConfig(model=src, name="atomic-llama", variants=("fp32", "int4"),
                                                      timing=False, reference_tokens=12), force=True)
    after = cache.verify_entry(folder)            # previous build intact and valid
    assert after.cache_key == before.cache_key
    assert not list((cache_dir / ".staging").iterdir()), "staging left behind"
    # A first build that dies leaves no loadable entry at all.
    with pytest.raises(KeyboardInterrupt):
        pipeline.build_tree_decoder(TreeDecoderConfig(model=src, name="never-built", variants=("fp32", "int4"),
                                                      timing=False, reference_tokens=12))
    assert not (cache_dir / "never-built").exists()


def test_identical_rebuild_is_a_cache_hit(tiny_llama):
    m = S.read_manifest(tiny_llama)
    cfg = TreeDecoderConfig.from_json(m.build_config)
    res = pipeline.build_tree_decoder(cfg)
    assert res.cache_hit and res.manifest.cache_key == m.cache_key


def test_lock_refuses_a_second_build(cache_dir):
    entered, release = threading.Event(), threading.Event()

    def hold():
        with cache.build_lock("locked-name"):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    entered.wait(5)
    try:
        with pytest.raises(CacheError, match="another build"):
            with cache.build_lock("locked-name"):
                pass
    finally:
        release.set()
        t.join()


def test_tampering_is_detected(cache_dir):
    folder = build_tiny("llama", cache_dir, name="tamper-llama", variants=("fp32", "int4"))
    cache.verify_entry(folder)
    f = folder / S.variant_file("int4")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="decoder_int4.onnx.*sha256.*dejavuu-build tree-decoder"):
        cache.verify_entry(folder)
    (folder / S.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CacheError, match="corrupted"):
        cache.verify_entry(folder)


def test_bad_names_refused():
    with pytest.raises(CacheError):
        cache.check_name("../etc")
