"""The cache: ~/.cache/dejavuu/<name>/, written atomically and locked per name. See cache-layout.md.

Pure Python so the runtime can use it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import CacheError, IntegrityError
from .schema import MANIFEST_FILE, Manifest, read_manifest, sha256_file

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def cache_root() -> Path:
    """DEJAVUU_CACHE, else $XDG_CACHE_HOME/dejavuu, else ~/.cache/dejavuu."""
    if env := os.environ.get("DEJAVUU_CACHE"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "dejavuu"
    return Path.home() / ".cache" / "dejavuu"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name or ""):
        raise CacheError(f"invalid cache name {name!r}: use letters, digits, '.', '_' or '-'")
    return name


def entry_dir(name: str) -> Path:
    return cache_root() / check_name(name)


def list_entries() -> list[str]:
    root = cache_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST_FILE).is_file())


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``name`` so two builds of it never clobber each other."""
    locks = cache_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{check_name(name)}.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CacheError(f"another build of {name!r} is running (lock {fh.name}); wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def staging(name: str) -> Iterator[Path]:
    """A private folder to build ``name`` in; committed with :func:`commit`, removed on failure.

    The runtime only loads ``<root>/<name>`` and that folder only ever appears by rename of a
    finished staging folder, so an interrupted build leaves nothing loadable.
    """
    tmp_root = cache_root() / ".staging"
    tmp_root.mkdir(parents=True, exist_ok=True)
    tmp = tmp_root / f"{check_name(name)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def commit(staged: Path, name: str) -> Path:
    """Swap a finished staging folder into place; the previous build survives until the swap."""
    if not (staged / MANIFEST_FILE).is_file():
        raise CacheError(f"refusing to commit {staged}: it has no {MANIFEST_FILE}")
    final = entry_dir(name)
    trash = None
    if final.exists():
        trash = cache_root() / ".staging" / f"{name}-old-{uuid.uuid4().hex[:8]}"
        os.replace(final, trash)
    os.replace(staged, final)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return final


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link when possible (same filesystem, no extra disk), else copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def record_files(folder: Path, manifest: Manifest) -> None:
    """Fill manifest.files with the sha256 and size of every file in ``folder``."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST_FILE and not p.name.endswith(".tmp"):
            rel = p.relative_to(folder).as_posix()
            files[rel] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest.files = files


def verify_entry(folder: Path, files: list[str] | None = None) -> Manifest:
    """Check every (or the named) file against manifest sha256s; raise IntegrityError on drift."""
    folder = Path(folder)
    if not (folder / MANIFEST_FILE).is_file():
        raise CacheError(f"{folder} has no {MANIFEST_FILE}: rebuild it with `dejavuu-build tree-decoder --name {folder.name}`")
    try:
        m = read_manifest(folder)
    except Exception as e:  # noqa: BLE001 - any parse failure is corruption
        raise CacheError(f"{folder / MANIFEST_FILE} is corrupted ({e}); rebuild with `dejavuu-build tree-decoder --name {folder.name} --force`") from None
    rebuild = _rebuild_hint(m, folder.name)
    for rel in (files if files is not None else list(m.files)):
        rec = m.files.get(rel)
        p = folder / rel
        if rec is None:
            raise IntegrityError(f"{p} is not listed in the manifest; {rebuild}")
        if not p.is_file():
            raise IntegrityError(f"{p} is missing; {rebuild}")
        if p.stat().st_size != rec["bytes"] or sha256_file(p) != rec["sha256"]:
            raise IntegrityError(f"{p} does not match its manifest sha256 (modified or corrupted); {rebuild}")
    return m


def _rebuild_hint(m: Manifest, name: str) -> str:
    cmd = {"datastore": "datastore", "vlm": "vlm"}.get(m.kind, "tree-decoder")
    return f"rebuild it with `dejavuu-build {cmd} --name {name} --force`"
