"""Cache: atomic writes, locking, cache hits, tamper detection."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import build_tiny

import dejavuu_build
from dejavuu_build import cache
from dejavuu_build import schema as S
from dejavuu_build.build import pipeline, sources
from dejavuu_build.build.config import TreeDecoderConfig, tool_versions
from dejavuu_build.errors import CacheError, IntegrityError


def clone(src: Path, name: str) -> Path:
    """A copy of a committed entry under another name (a valid entry: cheaper than a build)."""
    dst = cache.cache_root() / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def edit_manifest(folder: Path, fn) -> None:
    d = json.loads((folder / S.MANIFEST_FILE).read_text())
    fn(d)
    (folder / S.MANIFEST_FILE).write_text(json.dumps(d))


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
        pipeline.build_tree_decoder(
            TreeDecoderConfig(
                model=src, name="atomic-llama", variants=("fp32", "int4"), timing=False, reference_tokens=12
            ),
            force=True,
        )
    after = cache.verify_entry(folder)  # previous build intact and valid
    assert after.cache_key == before.cache_key
    assert not list((cache_dir / ".staging").iterdir()), "staging left behind"
    # A first build that dies leaves no loadable entry at all.
    with pytest.raises(KeyboardInterrupt):
        pipeline.build_tree_decoder(
            TreeDecoderConfig(
                model=src, name="never-built", variants=("fp32", "int4"), timing=False, reference_tokens=12
            )
        )
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


# ---------------------------------------------------------------- item 3: verify covers everything, inside the entry
def test_an_empty_file_list_does_not_verify(tiny_llama):
    folder = clone(tiny_llama, "empty-files")
    edit_manifest(folder, lambda d: d.update(files={}))
    f = folder / S.variant_file("int4")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="not listed in the manifest"):
        cache.verify_entry(folder)


def test_unlisted_file_in_the_entry_is_refused(tiny_llama):
    folder = clone(tiny_llama, "unlisted-file")
    edit_manifest(folder, lambda d: d["files"].pop("tokenizer.json"))
    with pytest.raises(IntegrityError, match="tokenizer.json is not listed"):
        cache.verify_entry(folder)


def test_variant_sha256_is_checked(tiny_llama):
    folder = clone(tiny_llama, "variant-sha")
    edit_manifest(folder, lambda d: d["variants"]["int4"].update(sha256="0" * 64))
    with pytest.raises(IntegrityError, match="int4.*sha256"):
        cache.verify_entry(folder)


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_paths_outside_the_entry_are_refused(tiny_llama, how):
    from dejavuu_build.runtime import load

    folder = clone(tiny_llama, f"escape-{how}")
    outside = folder.parent / f"outside-{how}.onnx"
    shutil.copy(folder / S.variant_file("int4"), outside)
    bad = f"../{outside.name}" if how == "dotdot" else str(outside)

    def point_outside(d):
        rec = d["files"].pop(S.variant_file("int4"))
        d["files"][bad] = rec
        d["variants"]["int4"]["file"] = bad

    edit_manifest(folder, point_outside)
    (folder / S.variant_file("int4")).unlink()
    with pytest.raises(IntegrityError, match="outside the entry"):
        cache.verify_entry(folder)
    with pytest.raises(IntegrityError, match="outside the entry"):
        load(folder, variant="int4")
    with pytest.raises(IntegrityError, match="outside the entry"):
        load(folder, variant="int4", verify=False)


def test_load_verifies_every_file_it_reads(tiny_llama):
    """The runtime skips only the other variants and the references: a tokenizer the manifest
    does not list is refused, not read."""
    from dejavuu_build.runtime import load

    folder = clone(tiny_llama, "load-unlisted")
    edit_manifest(folder, lambda d: d.update(files={k: v for k, v in d["files"].items() if k != "tokenizer.json"}))
    with pytest.raises(IntegrityError, match="tokenizer.json is not listed"):
        load(folder, variant="int4")


# ---------------------------------------------------------------- item 1: no build replaces what it did not build
def test_a_build_never_replaces_another_kind_of_entry(tiny_llama, tmp_path):
    from dejavuu_build.build.datastore import build_datastore

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"turns": ["abc abc abc"]}\n')
    ds = build_datastore(str(corpus), "tiny-llama", "kind-ds")
    before = (ds / S.MANIFEST_FILE).read_text()
    src = S.read_manifest(tiny_llama).source["path"]
    cfg = TreeDecoderConfig(model=src, name="kind-ds", variants=("fp32",), timing=False, reference_tokens=12)
    for force in (False, True):
        with pytest.raises(CacheError, match="kind-ds is a datastore"):
            pipeline.build_tree_decoder(cfg, force=force)
    assert (ds / S.MANIFEST_FILE).read_text() == before
    cache.verify_entry(ds)


def test_commit_refuses_a_folder_that_is_not_an_entry(cache_dir):
    results = cache_dir / "bench" / "run-1"
    results.mkdir(parents=True, exist_ok=True)
    (results / "records.jsonl").write_text("{}\n")
    with cache.build_lock("bench"):
        with cache.staging("bench") as tmp:
            S.write_json(tmp / S.MANIFEST_FILE, S.Manifest(name="bench", kind="datastore").to_json())
            with pytest.raises(CacheError, match="not a cache entry"):
                cache.commit(tmp, "bench")
    assert (results / "records.jsonl").is_file()


# ---------------------------------------------------------------- item 2: cache keys follow content
def test_folder_identity_follows_its_content(tmp_path, monkeypatch):
    from tiny import save_tiny

    a, b = tmp_path / "a", tmp_path / "b"
    save_tiny("llama", a / "m")
    save_tiny("llama", b / "m", seed=1)
    monkeypatch.chdir(a)
    id_a = sources.resolve("./m").identity
    assert sources.resolve("./m").identity == id_a  # deterministic
    monkeypatch.chdir(b)
    id_b = sources.resolve("./m").identity
    assert id_b != id_a  # same words, other folder
    save_tiny("llama", b / "m", seed=0)
    assert sources.resolve("./m").identity == id_a  # same content, same identity
    cfg = TreeDecoderConfig(model="./m", variants=("fp32",))
    from dejavuu_build.build.config import cache_key

    assert cache_key(cfg, id_a, tool_versions()) == cache_key(cfg, id_a, tool_versions())


def test_changed_weights_are_not_a_cache_hit(cache_dir, tmp_path):
    from tiny import save_tiny

    src = save_tiny("llama", tmp_path / "weights")
    cfg = TreeDecoderConfig(model=str(src), name="content-key", variants=("fp32",), timing=False, reference_tokens=12)
    first = pipeline.build_tree_decoder(cfg)
    assert pipeline.build_tree_decoder(cfg).cache_hit
    save_tiny("llama", src, seed=1)  # new weights in the same folder
    with pytest.raises(CacheError, match="--force"):
        pipeline.build_tree_decoder(cfg)
    again = pipeline.build_tree_decoder(cfg, force=True)
    assert not again.cache_hit and again.manifest.cache_key != first.manifest.cache_key


def test_tool_versions_hash_the_package_code(tmp_path):
    """The key follows the import closure of the pipeline: any module it runs (the runtime code the
    gates run included) changes it, code it never imports does not, and a module it names but
    that is missing fails loudly."""
    tools = tool_versions()
    assert tools == tool_versions()
    pkg = Path(dejavuu_build.__file__).parent
    copy = tmp_path / "pkg"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cache.code_digest(copy) == tools["dejavuu-build-code"]
    closure = {f.relative_to(copy).as_posix() for f in cache.import_closure(copy)}
    for part in (
        "export/exporter.py",
        "quantize/nbits.py",
        "recipes/llama.py",
        "build/sources.py",
        "runtime/session.py",
        "runtime/decoder.py",
        "layouts/base.py",
        "layouts/rowwise.py",
        "runtime/tree.py",
        "export/passes/serve_batch.py",  # the serving batch graph is written and gated at build
        "serve/batch.py",
    ):
        assert part in closure, part
        f = copy / part
        original = f.read_text()
        f.write_text(original + "\n# changed\n")
        assert cache.code_digest(copy) != tools["dejavuu-build-code"], part
        f.write_text(original)
    # never imported by a build (a drafter, the engine: not even through the gates' runtime Decoder)
    for outside in ("serve/app.py", "bench/runner.py", "runtime/drafters/suffix.py", "runtime/engine.py"):
        assert outside not in closure
        (copy / outside).write_text("# does not shape the artifacts\n")
    assert cache.code_digest(copy) == tools["dejavuu-build-code"]
    (copy / "layouts" / "base.py").unlink()
    with pytest.raises(ImportError, match="layouts.base, which is not in the package"):
        cache.code_digest(copy)


def test_quant_only_records_the_tools_it_ran_with(tiny_llama, monkeypatch):
    folder = clone(tiny_llama, "requant-tools")
    before = S.read_manifest(folder)
    newer = {**before.tools, "onnxruntime": "99.0"}
    monkeypatch.setattr(pipeline, "tool_versions", lambda: newer)
    res = pipeline.quant_only("requant-tools", variants=("int4",), timing=False)
    assert res.manifest.tools == newer and res.manifest.cache_key != before.cache_key
    # A build with the old tools would not produce this entry: no cache hit on it.
    monkeypatch.setattr(pipeline, "tool_versions", lambda: before.tools)
    cfg = TreeDecoderConfig.from_json({**before.build_config, "name": "requant-tools"})
    with pytest.raises(CacheError, match="--force"):
        pipeline.build_tree_decoder(cfg)


# ---------------------------------------------------------------- item 7: readers never see half a rebuild
def _datastore(tmp_path, name, text):
    from dejavuu_build.build.datastore import build_datastore

    corpus = tmp_path / f"{name}-{len(text)}.jsonl"
    corpus.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in text))
    return corpus, build_datastore


def test_a_swap_during_a_load_is_retried_not_an_error(tiny_llama, tmp_path, monkeypatch):
    from dejavuu_build.runtime.model import load_datastore

    old_src, build = _datastore(tmp_path, "swap", ["abc abc"])
    new_src, _ = _datastore(tmp_path, "swap", ["abc abc", "xyz xyz", "q r s"])
    build(str(old_src), "tiny-llama", "swap-ds")
    real = cache.sha256_file
    fired = []

    def rebuild_midway(path, *a, **k):
        if not fired:  # the reader has read the old manifest; the entry is swapped now
            fired.append(1)
            build(str(new_src), "tiny-llama", "swap-ds", force=True)
        return real(path, *a, **k)

    monkeypatch.setattr(cache, "sha256_file", rebuild_midway)
    ds = load_datastore("swap-ds")
    assert fired and ds.n_docs == 3


def test_a_reader_waits_out_the_gap_of_a_two_rename_swap(tiny_llama, tmp_path):
    from dejavuu_build.runtime.model import load_datastore

    src, build = _datastore(tmp_path, "gap", ["abc abc"])
    final = build(str(src), "tiny-llama", "gap-ds")
    trash = cache.cache_root() / ".staging" / "gap-ds" / "old-test"
    trash.parent.mkdir(parents=True, exist_ok=True)
    os.replace(final, trash)  # the first of the fallback's two renames
    out = []
    t = threading.Thread(target=lambda: out.append(_try(load_datastore, "gap-ds")))
    t.start()
    time.sleep(0.3)
    os.replace(trash, final)  # ... and the second
    t.join(30)
    assert out and not isinstance(out[0], Exception), out
    assert out[0].n_docs == 1


def _try(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - returned to the test thread
        return e


def test_commit_swaps_atomically(tiny_llama, tmp_path):
    """While a datastore is rebuilt again and again, a reader polling it never finds it missing."""
    src, build = _datastore(tmp_path, "poll", ["abc abc"])
    final = build(str(src), "tiny-llama", "poll-ds")
    stop, missing = threading.Event(), []

    def poll():
        while not stop.is_set():
            if not (final / S.MANIFEST_FILE).is_file():
                missing.append(1)

    t = threading.Thread(target=poll)
    t.start()
    try:
        for _ in range(20):
            build(str(src), "tiny-llama", "poll-ds", force=True)
    finally:
        stop.set()
        t.join()
    assert not missing


def test_stale_staging_of_a_killed_build_is_cleaned_under_the_lock(cache_dir):
    code = (
        "import os\n"
        "from dejavuu_build.cache import build_lock, staging\n"
        "with build_lock('killed'):\n"
        "    with staging('killed') as t:\n"
        "        (t / 'half.onnx').write_bytes(b'x' * 100)\n"
        "        os.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, DEJAVUU_CACHE=str(cache_dir)),
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == -9
    debris = [p for p in (cache_dir / ".staging").rglob("half.onnx")]
    assert debris
    with cache.build_lock("killed"):
        assert not any(p.exists() for p in debris)


# ---------------------------------------------------------------- item 12: the cache imports without fcntl
def test_cache_and_runtime_import_without_fcntl():
    code = (
        "import sys\n"
        "sys.modules['fcntl'] = None\n"  # as on Windows: `import fcntl` raises ImportError
        "import dejavuu_build.cache\n"
        "import dejavuu_build.runtime\n"
        "from dejavuu_build.runtime import load\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_legacy_staging_debris_of_this_name_only_is_cleaned(cache_dir):
    st = cache_dir / ".staging"
    mine = [st / "legacy-4242-deadbeef", st / "legacy-old-0badf00d"]
    others = [st / "legacy-4242-4242-deadbeef", st / "legacy-old-4242-deadbeef", st / "legacy2-1-deadbeef"]
    for d in mine + others:
        d.mkdir(parents=True, exist_ok=True)
        (d / "x").write_text("x")
    with cache.build_lock("legacy"):
        assert not any(d.exists() for d in mine)
        assert all(d.exists() for d in others)  # builds of other names ("legacy-4242", "legacy-old", "legacy2")
