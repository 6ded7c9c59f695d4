"""Where the serving batch graph (export.passes.serve_batch) of a static-KV decoder lives: written
once per source graph under the cache, beside a record of its sha256 and size, checked on every
use and rewritten atomically, under a lock, when missing or wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from ..export.passes.serve_batch import GRAPH_VERSION, to_serve_batch
from ..log import logger
from ..schema import BATCHED_FILE, BATCHED_RECORD_FILE

TMP_MARK = ".tmp"  # a graph or record being written (a dead writer's, once the lock is held)


def batched_graph(src: Path, dst: Path) -> None:
    """Write the batched flavour of the static decoder ``src`` to ``dst`` (atomically)."""
    import onnx

    m = to_serve_batch(onnx.load(str(src)), src.name)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}{TMP_MARK}{os.getpid()}")
    try:
        onnx.save(m, str(tmp))
        with open(tmp, "rb+") as f:  # on disk before it is renamed into place
            os.fsync(f.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
        raise


def batched_path(src: Path, cache: Path) -> Path:
    """Where the batched flavour of ``src`` lives: keyed by the source graph's bytes, so a rebuilt
    decoder gets a new one and a stale one is never used."""
    h = hashlib.sha256(f"batched-graph-v{GRAPH_VERSION}".encode())
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return cache / h.hexdigest()[:24] / BATCHED_FILE


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _intact(path: Path) -> bool:
    """The graph at ``path`` is the one its record describes (size and sha256): not truncated by a
    kill or a full disk, not edited since it was written."""
    try:
        rec = json.loads((path.parent / BATCHED_RECORD_FILE).read_text())
        return (
            isinstance(rec, dict)
            and rec.get("version") == GRAPH_VERSION
            and path.is_file()
            and path.stat().st_size == rec.get("bytes")
            and _sha256(path) == rec.get("sha256")
        )
    except (OSError, ValueError):
        return False


def _locked(folder: Path, wait_s: float = 600.0):
    """An exclusive lock on ``folder`` (one writer of a batched graph at a time, across servers)."""
    from contextlib import contextmanager

    from ..cache import _try_lock, _unlock

    @contextmanager
    def hold():
        with open(folder / ".lock", "a+") as fh:
            deadline = time.monotonic() + wait_s
            while not _try_lock(fh):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another server kept {folder} locked for {wait_s:.0f} s")
                time.sleep(0.05)
            try:
                yield
            finally:
                _unlock(fh)

    return hold()


def _sweep(folder: Path) -> None:
    """Remove a killed writer's temp files beside a good graph, if no writer holds the lock now
    (best effort: a read-only cache keeps them, and they are never read)."""
    from ..cache import _try_lock, _unlock

    try:
        temps = [p for p in folder.iterdir() if TMP_MARK in p.name]
        if not temps:
            return
        with open(folder / ".lock", "a+") as fh:
            if _try_lock(fh):
                try:
                    for p in temps:
                        p.unlink(missing_ok=True)
                finally:
                    _unlock(fh)
    except OSError:
        pass


def ensure_batched(src: Path, cache: Path) -> Path:
    """The batched flavour of ``src`` under ``cache``, checked against its record (sha256, size) on
    every use and rewritten when missing or wrong, atomically, under a lock; a dead writer's temp
    files are removed. Raises OSError when it cannot be written (a read-only or full cache)."""
    path = batched_path(src, cache)
    if _intact(path):  # the common case reads only: a read-only cache with a good graph serves batched
        _sweep(path.parent)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):
        for p in path.parent.iterdir():  # no other writer holds the lock: these are a killed one's
            if TMP_MARK in p.name:
                p.unlink(missing_ok=True)
        if _intact(path):  # written by another server while we waited
            return path
        (path.parent / BATCHED_RECORD_FILE).unlink(missing_ok=True)
        logger.info("writing the batched flavour of %s to %s", src.name, path)
        batched_graph(src, path)
        rec = {"version": GRAPH_VERSION, "sha256": _sha256(path), "bytes": path.stat().st_size, "source": src.name}
        tmp = path.parent / f"{BATCHED_RECORD_FILE}{TMP_MARK}{os.getpid()}"
        try:
            tmp.write_text(json.dumps(rec, indent=2) + "\n")
            os.replace(tmp, path.parent / BATCHED_RECORD_FILE)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return path
