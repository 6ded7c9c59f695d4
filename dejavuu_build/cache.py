"""The cache: ~/.cache/dejavuu/<name>/, written atomically and locked per name. See cache-layout.md.

Pure Python so the runtime can use it; importable on every platform (the lock imports ``fcntl``
or, on Windows, ``msvcrt`` only when a build takes it).

Guarantees:

* a build only replaces an entry of its own kind, and never a folder that is not an entry;
* ``<name>/`` changes only by an atomic swap (``renameat2(RENAME_EXCHANGE)`` on Linux; two
  renames elsewhere, which readers wait out), so a reader that goes through :func:`read_entry`
  sees the old entry or the new one, never a mix or a gap;
* a build in progress lives in ``.staging/<name>/``; what a killed build left there is removed
  by the next build of that name, under its lock;
* :func:`verify_entry` covers every file of an entry, every variant's recorded sha256, and
  refuses a manifest that points outside the entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Callable, Iterable, Iterator, TypeVar

from .errors import CacheError, IntegrityError
from .schema import (
    CONTRACT_FILE,
    DATASTORE_FILE,
    DATASTORE_SUFFIXES_FILE,
    DATASTORE_TOKENS_FILE,
    EMBED_FILE,
    ENTRY_KINDS,
    KIND_DATASTORE,
    KIND_DECODER,
    KIND_VLM,
    KV_ROWWISE,
    LOCKS_DIR,
    MANIFEST_FILE,
    MANIFEST_SCHEMA_VERSION,
    PREPROCESSOR_FILE,
    SCHEMA_VERSION,
    STAGING_DIR,
    VISION_FILE,
    VLM_FILE,
    Contract,
    Manifest,
    batched_inputs,
    read_manifest,
    sha256_file,
)

T = TypeVar("T")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# Files every entry of a kind must list (beyond what is on disk, which must all be listed too).
KINDS = ENTRY_KINDS
REQUIRED_FILES = {
    KIND_DECODER: (CONTRACT_FILE,),
    KIND_VLM: (CONTRACT_FILE, EMBED_FILE, VISION_FILE, VLM_FILE, PREPROCESSOR_FILE),
    KIND_DATASTORE: (DATASTORE_TOKENS_FILE, DATASTORE_SUFFIXES_FILE, DATASTORE_FILE),
}
# What shapes a build's artifacts: the modules the pipeline imports (import_closure), hashed into
# the cache key (tool_versions) besides the versions.
BUILD_ROOT = "build/pipeline.py"
PACKAGE = "dejavuu_build"


def cache_root() -> Path:
    """DEJAVUU_CACHE, else $XDG_CACHE_HOME/dejavuu, else ~/.cache/dejavuu."""
    if env := os.environ.get("DEJAVUU_CACHE"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "dejavuu"
    return Path.home() / ".cache" / "dejavuu"


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise CacheError(
            f"invalid cache name {name!r}: use up to 128 letters, digits, '.', '_' or '-' "
            f"(starting with a letter or digit)"
        )
    return name


def entry_dir(name: str) -> Path:
    return cache_root() / check_name(name)


def is_path_like(name_or_path) -> bool:
    """A path (``./x``, ``a/b``, ``~/x``, ``/x``, ``x.onnx``, a Path object) rather than a cache name.

    A bare word is always a cache name, so a same-named folder in the current directory never
    shadows a cache entry (pass ``./word`` for the folder)."""
    if isinstance(name_or_path, os.PathLike):
        return True
    s = str(name_or_path)
    return "/" in s or "\\" in s or s.startswith((".", "~")) or s.lower().endswith(".onnx") or Path(s).is_absolute()


def locate(name_or_path) -> Path:
    """The folder named: a path as given, or the cache entry of a bare name."""
    if is_path_like(name_or_path):
        return Path(name_or_path).expanduser()
    return entry_dir(str(name_or_path))


def list_entries() -> list[str]:
    root = cache_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / MANIFEST_FILE).is_file())


def import_closure(package_root: str | os.PathLike | None = None, root: str = BUILD_ROOT) -> list[Path]:
    """Every module of the package that ``root`` imports, directly or through others, at module
    level or inside a function (the pipeline imports lazily), with the ``__init__.py`` of each
    package on the way: the code that shapes a build, read from the source, so no hand-kept list
    can miss a part. Imports under ``if TYPE_CHECKING:`` never run, so they do not count (a type
    named for the checker, such as serve.batch's runtime.model.Model, shapes nothing). A module an
    import names that does not exist raises (the key never silently skips code);
    ``from .m import name`` counts ``m.name`` only where that is a module."""
    import ast

    def imports(tree: ast.AST):
        """Every import statement of ``tree`` but those under ``if TYPE_CHECKING:``."""
        todo = [tree]
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If) and (
                (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
                or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
            ):
                todo.extend(node.orelse)
            else:
                todo.extend(ast.iter_child_nodes(node))

    base = Path(package_root) if package_root is not None else Path(__file__).resolve().parent

    def module(parts: list[str]) -> Path | None:
        p = base.joinpath(*parts)
        return (
            p / "__init__.py"
            if (p / "__init__.py").is_file()
            else p.with_suffix(".py")
            if parts and p.with_suffix(".py").is_file()
            else None
        )

    found: dict[str, Path] = {}
    todo = [base / root]
    while todo:
        f = todo.pop()
        rel = f.relative_to(base).as_posix()
        if rel in found:
            continue
        found[rel] = f
        here = list(f.relative_to(base).parent.parts)  # the package f belongs to
        for i in range(len(here)):  # importing a.b runs a/__init__ first
            if (init := base.joinpath(*here[: i + 1], "__init__.py")).is_file():
                todo.append(init)
        for node in imports(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            named: list[tuple[list[str], bool]] = []  # (module parts, must exist)
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
                elif node.module and node.module.split(".")[0] == PACKAGE:
                    target = node.module.split(".")[1:]
                else:
                    continue
                named.append((target, True))
                named += [(target + [a.name], False) for a in node.names]
            elif isinstance(node, ast.Import):
                named += [(a.name.split(".")[1:], True) for a in node.names if a.name.split(".")[0] == PACKAGE]
            for parts, required in named:
                p = module(parts)
                if p is None and required and parts:
                    raise ImportError(
                        f"{rel} imports {'.'.join([PACKAGE, *parts])}, which is not in the package: "
                        f"the build's code cannot be hashed"
                    )
                if p is not None:
                    todo.append(p)
    return sorted(found.values(), key=lambda p: p.relative_to(base).as_posix())


def code_digest(package_root: str | os.PathLike | None = None) -> str:
    """sha256 of the package code that shapes a build (import_closure of the pipeline): relative
    path + bytes of every module, in sorted order, and the sources of the native operators
    (kernels/) the closure reaches, whose arithmetic the gates measure."""
    base = Path(package_root) if package_root is not None else Path(__file__).resolve().parent
    h = hashlib.sha256()
    files = import_closure(base)
    native = {
        f for py in files if py.parent.name == "kernels" for f in py.parent.rglob("*") if f.suffix in (".cpp", ".h")
    }
    for f in files + sorted(native, key=lambda p: p.relative_to(base).as_posix()):
        h.update(f.relative_to(base).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------------ locking, staging
def _staging_dir(name: str) -> Path:
    return cache_root() / STAGING_DIR / check_name(name)


def _try_lock(fh) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fh.fileno(), msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]  # Windows only
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _unlock(fh) -> None:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        fh.seek(0)
        msvcrt.locking(fh.fileno(), msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]  # Windows only
        return
    fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``name`` so two builds of it never clobber each other.

    Whatever ``.staging/<name>/`` still holds belongs to a build of this name that died (SIGKILL,
    power loss): no build of it can be running while we hold the lock, so it is removed."""
    locks = cache_root() / LOCKS_DIR
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{check_name(name)}.lock", "a+") as fh:
        if not _try_lock(fh):
            raise CacheError(f"another build of {name!r} is running (lock {fh.name}); wait for it to finish")
        try:
            stale = _staging_dir(name)
            if stale.is_dir():
                for p in stale.iterdir():
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            # ... and what older versions left as .staging/<name>-<pid>-<rand> or <name>-old-<rand>
            legacy = re.compile(re.escape(name) + r"-(\d+|old)-[0-9a-f]{8}")
            for p in stale.parent.iterdir() if stale.parent.is_dir() else ():
                if p.is_dir() and legacy.fullmatch(p.name):
                    shutil.rmtree(p, ignore_errors=True)
            yield
        finally:
            _unlock(fh)


@contextmanager
def staging(name: str) -> Iterator[Path]:
    """A private folder to build ``name`` in; committed with :func:`commit`, removed on failure.

    The runtime only loads ``<root>/<name>`` and that folder only ever appears by an atomic swap
    with a finished staging folder, so an interrupted build leaves nothing loadable."""
    parent = _staging_dir(name)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        _rmdir_quietly(parent)


def _rmdir_quietly(p: Path) -> None:
    try:
        p.rmdir()
    except OSError:
        pass


def _kind_of(folder: Path) -> str | None:
    """The kind recorded in ``folder``'s manifest; None when it has none ('?' when unreadable)."""
    if not (folder / MANIFEST_FILE).is_file():
        return None
    try:
        return read_manifest(folder).kind
    except Exception:  # noqa: BLE001 - unreadable manifest: an entry of unknown kind
        return "?"


def _not_an_entry(final: Path) -> CacheError:
    return CacheError(
        f"{final} exists and is not a cache entry (no {MANIFEST_FILE}): nothing will replace it; "
        f"choose another --name or move that folder away"
    )


def check_replace(name: str, kind: str, *, force: bool, key: str | None = None) -> Manifest | None:
    """Decide, under the build lock, what a build of ``kind`` may do with an existing ``<name>``.

    Returns the existing (verified) manifest when it is an identical build (same ``key``, no
    ``force``): a cache hit. Returns None when there is nothing to keep (no entry, or ``force``).
    Raises CacheError when ``<name>`` is a folder that is not an entry, an entry of another kind
    (even with ``force``: no command replaces what it did not build), or a different or broken
    build of this kind without ``force``."""
    final = entry_dir(name)
    if not final.exists():
        return None
    old = _kind_of(final)
    if old is None:
        raise _not_an_entry(final)
    if old not in (kind, "?"):
        raise CacheError(
            f"{name} is a {old} build in {final}: a {kind} build will not replace it; "
            f"choose another --name (or delete that folder yourself)"
        )
    if force:
        return None
    try:
        m = verify_entry(final)
    except CacheError as e:
        raise CacheError(f"{name} already exists but does not verify ({e}); pass --force to rebuild it") from None
    if key is not None and m.cache_key == key:
        return m
    raise CacheError(
        f"{name} already holds a different {kind} build ({_describe(m)}); "
        f"pass --force to replace it, or choose another --name"
    )


def _describe(m: Manifest) -> str:
    src = m.source.get("id") or m.source.get("path") or "?"
    return f"from {src}, built {m.created or '?'}"


# ------------------------------------------------------------------------------ the atomic swap
def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    return False  # EINVAL/ENOSYS (filesystem or kernel without it): fall back to two renames


def commit(staged: Path, name: str) -> Path:
    """Swap a finished staging folder into place; the previous build survives until the swap.

    Refuses to replace a folder that is not an entry, or an entry of another kind."""
    if not (staged / MANIFEST_FILE).is_file():
        raise CacheError(f"refusing to commit {staged}: it has no {MANIFEST_FILE}")
    final = entry_dir(name)
    if final.exists():
        old, new = _kind_of(final), _kind_of(staged)
        if old is None:
            raise _not_an_entry(final)
        if old not in (new, "?"):
            raise CacheError(f"{name} is a {old} build in {final}: a {new} build will not replace it")
        if _exchange(staged, final):  # final now holds the new build, staged the old one
            shutil.rmtree(staged, ignore_errors=True)
            _rmdir_quietly(staged.parent)
            return final
        trash = _staging_dir(name) / f"old-{uuid.uuid4().hex[:8]}"  # readers wait while this exists
        os.replace(final, trash)
        os.replace(staged, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staged, final)
    _rmdir_quietly(staged.parent)
    return final


def _stamp(folder: Path):
    """Identity of the directory now at ``folder`` (changes with every swap); None if missing."""
    try:
        st = os.stat(folder)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _swap_in_progress(folder: Path) -> bool:
    """The gap of a two-rename swap: the old entry sits in .staging/<name>/old-* for a moment."""
    d = folder.parent / STAGING_DIR / folder.name
    try:
        return any(p.name.startswith("old-") for p in d.iterdir())
    except OSError:
        return False


def read_entry(folder: str | os.PathLike, read: Callable[[Path], T], *, wait_s: float = 30.0) -> T:
    """Run ``read(folder)`` so that everything it read came from one committed build.

    Entries are immutable once committed and change only by a swap, so: note which directory is
    at ``folder``, read, and check it is still the same one. If a rebuild swapped it meanwhile,
    read again (the new build); an error raised while a swap happened is a symptom of the swap,
    not of corruption, and is retried too. A reader that arrives in the gap of a two-rename swap
    waits for the new entry."""
    folder = Path(folder)
    deadline = time.monotonic() + wait_s
    while True:
        before = _stamp(folder)
        if before is None and _swap_in_progress(folder) and time.monotonic() < deadline:
            time.sleep(0.01)
            continue
        try:
            out = read(folder)
        except Exception:
            if _stamp(folder) != before and time.monotonic() < deadline:
                continue
            raise
        if _stamp(folder) == before:
            return out
        if time.monotonic() >= deadline:
            raise CacheError(f"{folder} kept being rebuilt while it was read; try again")


# ------------------------------------------------------------------------------ files and integrity
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


def member(folder: str | os.PathLike, rel: str, rebuild: str = "rebuild it") -> Path:
    """``folder / rel`` for a path a manifest names, refused unless it stays inside ``folder``."""
    folder = Path(folder)
    bad = (
        not isinstance(rel, str)
        or not rel
        or "\0" in rel
        or PurePosixPath(rel).is_absolute()
        or PureWindowsPath(rel).is_absolute()
        or PureWindowsPath(rel).drive
        or ".." in PurePosixPath(rel.replace("\\", "/")).parts
    )
    p = folder / rel if not bad else None
    if p is not None:
        try:
            inside = p.resolve().is_relative_to(folder.resolve())
        except (OSError, RuntimeError):
            inside = False
        bad = not inside
    if bad or p is None:
        raise IntegrityError(
            f"{folder / MANIFEST_FILE} names {rel!r}, a path outside the entry; "
            f"the manifest was tampered with: {rebuild}"
        )
    return p


def no_manifest(folder: Path) -> CacheError:
    """What every reader says of a folder without a manifest: nothing in it can be checked, and no
    build replaces such a folder, so it has to be moved away before the rebuild."""
    cmd = "datastore --from FILE --tokenizer MODEL" if (folder / DATASTORE_FILE).is_file() else "tree-decoder"
    return CacheError(
        f"{folder} has no {MANIFEST_FILE}, so none of its files can be checked: move that folder "
        f"away, then rebuild it with `dejavuu-build {cmd} --name {_name_for_hint(folder)}`"
    )


def _check_fields(m: Manifest) -> None:
    """Refuse a parsed manifest whose fields have the wrong types (a hand edit, a truncation):
    readers index and compare them, and a wrong type would pass as "verified" or crash later."""
    if not isinstance(m.files, dict) or not all(
        isinstance(k, str)
        and isinstance(r, dict)
        and isinstance(r.get("sha256"), str)
        and isinstance(r.get("bytes"), int)
        and not isinstance(r.get("bytes"), bool)
        for k, r in m.files.items()
    ):
        raise ValueError("files is not a mapping of path -> {sha256, bytes}")
    if not isinstance(m.kind, str) or m.kind not in KINDS:
        raise ValueError(f"kind {m.kind!r} is not one of {', '.join(KINDS)}")
    for v, rec in m.variants.items():
        if not isinstance(rec.file, str):
            raise ValueError(f"variant {v!r} names no file")
    if m.default_variant is not None and (
        not isinstance(m.default_variant, str) or m.default_variant not in m.variants
    ):
        raise ValueError(
            f"default_variant {m.default_variant!r} is not one of its variants ({', '.join(m.variants) or 'none'})"
        )
    if m.default_variant is not None and m.variants[m.default_variant].passed is not True:
        raise ValueError(
            f"default_variant {m.default_variant!r} is recorded as failing its gates (passed: "
            f"{m.variants[m.default_variant].passed!r}); a build only makes a passing variant its default"
        )
    _check_batched(m)


def _check_batched(m: Manifest) -> None:
    """Manifest.batched: {} (none), {"skipped": why}, or the record of a graph the entry holds."""
    b = m.batched
    if not isinstance(b, dict):
        raise ValueError(f"batched is {str(json.dumps(b))[:40]}, not a record")
    if "skipped" in b and not isinstance(b["skipped"], str):
        raise ValueError("batched.skipped is not text")
    if "file" not in b:
        return
    if not isinstance(b["file"], str) or not b["file"]:
        raise ValueError(f"batched.file is {str(json.dumps(b['file']))[:40]}, not a file name")
    if not isinstance(b.get("sha256"), str) or not isinstance(b.get("bytes"), int) or isinstance(b["bytes"], bool):
        raise ValueError("batched names a file without its sha256 and size")
    if not isinstance(b.get("variant"), str) or b["variant"] not in m.variants:
        raise ValueError(f"batched.variant {b.get('variant')!r} is not one of its variants")
    for key, kind in (("passed", bool), ("graph_version", int)):
        if key in b and not isinstance(b[key], kind):
            raise ValueError(f"batched.{key} is {str(json.dumps(b[key]))[:40]}")


def _provenance_files(raw: dict, m: Manifest) -> list[tuple[str, str | None, str | None]]:
    """(path, sha256 or None, the file the manifest's own fields name for it or None) of every file
    manifest.json's `provenance` view names: what the `dejavuu` package opens. Types only here;
    verify_entry checks the paths."""
    view = raw.get("provenance")
    if view is None:
        return []
    if not isinstance(view, dict):
        raise ValueError("provenance is not a mapping")
    out: list[tuple[str, str | None, str | None]] = []
    variants = view.get("variants", {})
    if not isinstance(variants, dict):
        raise ValueError("provenance.variants is not a mapping")
    for v, rec in variants.items():
        if not isinstance(rec, dict) or not isinstance(rec.get("file"), str):
            raise ValueError(f"provenance.variants.{v} names no file")
        sha = rec.get("sha256")
        if sha is not None and not isinstance(sha, str):
            raise ValueError(f"provenance.variants.{v}.sha256 is not text")
        out.append((rec["file"], sha, m.variants[v].file if v in m.variants else None))
    graphs = view.get("graphs", {})
    if not isinstance(graphs, dict):
        raise ValueError("provenance.graphs is not a mapping")
    own = {"embed_tokens": EMBED_FILE, "vision_encoder": VISION_FILE}
    for role, per in graphs.items():
        if not isinstance(per, dict) or not all(isinstance(rel, str) for rel in per.values()):
            raise ValueError(f"provenance.graphs.{role} is not a mapping of variant -> file")
        for v, rel in per.items():
            want = (m.variants[v].file if v in m.variants else None) if role == "decoder" else own.get(role)
            out.append((rel, None, want if v in m.variants else None))
    return out


def _unknown_version(folder: Path, version) -> CacheError:
    from . import __version__

    return CacheError(
        f"{folder / MANIFEST_FILE} has schema_version {version!r}, which dejavuu-build {__version__} does "
        f"not read (it reads 1 to {MANIFEST_SCHEMA_VERSION}): use the dejavuu-build that wrote it, or rebuild "
        f"it with `dejavuu-build tree-decoder --name {_name_for_hint(folder)} --force`"
    )


def _name_for_hint(folder: Path) -> str:
    """The entry's name for a command to suggest: its folder's, or NAME where that is no cache name
    (``..``, ``.``)."""
    name = folder.resolve().name if folder.name in ("", ".", "..") else folder.name
    return name if _NAME_RE.fullmatch(name or "") else "NAME"


def read_checked_manifest(folder: str | os.PathLike) -> Manifest:
    """The manifest of ``folder``, parsed and type-checked; CacheError when missing, of a schema
    version this code does not read, or corrupted."""
    return _read_checked(Path(folder))[0]


def _read_checked(folder: Path) -> tuple[Manifest, list[tuple[str, str | None, str | None]]]:
    """(the checked manifest, the files its provenance view names)."""
    if not (folder / MANIFEST_FILE).is_file():
        raise no_manifest(folder)
    try:
        raw = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        version = raw.get("schema_version", 1)
    except Exception as e:  # noqa: BLE001 - any parse failure is corruption
        raise _corrupted(folder, e) from None
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MANIFEST_SCHEMA_VERSION:
        raise _unknown_version(folder, version)
    try:
        m = Manifest.from_json(raw)
        _check_fields(m)
        provenance = _provenance_files(raw, m)
    except Exception as e:  # noqa: BLE001 - any parse failure is corruption
        raise _corrupted(folder, e) from None
    return m, provenance


def _corrupted(folder: Path, e: BaseException) -> CacheError:
    return CacheError(
        f"{folder / MANIFEST_FILE} is corrupted ({' '.join(str(e).split())[:200]}); rebuild it with "
        f"`dejavuu-build tree-decoder --name {_name_for_hint(folder)} --force`"
    )


def verify_entry(folder: str | os.PathLike, files: list[str] | None = None, *, skip: Iterable[str] = ()) -> Manifest:
    """Check an entry against its manifest; raise IntegrityError on drift.

    Without ``files``: every file on disk, every file the manifest lists, every variant file and
    the files its kind requires (less ``skip``: what the caller will not read) must be listed,
    present, plain files inside the entry and match its sha256; each checked variant's own recorded
    sha256 must agree. With ``files``: just those (and the variants among them)."""
    folder = Path(folder)
    m, provenance = _read_checked(folder)
    rebuild = rebuild_hint(m, _name_for_hint(folder))
    for rel in m.files:
        member(folder, rel, rebuild)
    for rec in m.variants.values():
        member(folder, rec.file, rebuild)
    # the serving batch graph and the provenance view's files: inside the entry, and listed (so
    # hashed) with the sha256 their records give
    named = [(rel, sha, want, "the manifest's provenance view") for rel, sha, want in provenance]
    if "file" in m.batched:
        named.append((m.batched["file"], m.batched["sha256"], "", "its batched graph record"))
    for v, rec in m.variants.items():
        if rec.prefill.get("file"):
            named.append((rec.prefill["file"], rec.prefill.get("sha256"), "", f"{v}'s prefill graph record"))
    for rel, sha, want, what in named:
        member(folder, rel, rebuild)
        if want is None or (want and rel != want):
            raise IntegrityError(f"{what} names {rel} where the manifest's own records name another file; {rebuild}")
        listed = m.files.get(rel)
        if listed is None:
            raise IntegrityError(f"{what} names {rel}, which is not listed in the manifest's files; {rebuild}")
        if sha is not None and sha != listed["sha256"]:
            raise IntegrityError(f"{what} records another sha256 for {rel} than its files do; {rebuild}")
    if "file" in m.batched and m.batched["bytes"] != m.files[m.batched["file"]]["bytes"]:
        raise IntegrityError(f"its batched graph record gives another size for {m.batched['file']}; {rebuild}")
    if files is None:
        on_disk = {
            p.relative_to(folder).as_posix()
            for p in folder.rglob("*")
            if (p.is_file() or p.is_symlink()) and p.relative_to(folder).as_posix() != MANIFEST_FILE
        }
        wanted = (
            set(m.files) | on_disk | set(REQUIRED_FILES.get(m.kind, ())) | {r.file for r in m.variants.values()}
        ) - set(skip)
    else:
        wanted = set(files)
    for rel in sorted(wanted):
        listed = m.files.get(rel)
        here = folder / rel
        if here.is_symlink():  # named as found: a link is not the manifest's doing
            raise IntegrityError(
                f"{here} is a symbolic link{'' if listed else ' not listed in the manifest'}: an entry "
                f"holds plain files only; {rebuild}"
            )
        if listed is None:
            raise IntegrityError(f"{here} is not listed in the manifest; {rebuild}")
        p = member(folder, rel, rebuild)
        if not p.is_file():
            raise IntegrityError(f"{p} is missing; {rebuild}")
        if p.stat().st_size != listed.get("bytes") or sha256_file(p) != listed.get("sha256"):
            raise IntegrityError(f"{p} does not match its manifest sha256 (modified or corrupted); {rebuild}")
    for v, rec in m.variants.items():
        if rec.file in wanted and (
            rec.sha256 != m.files[rec.file]["sha256"] or rec.bytes != m.files[rec.file]["bytes"]
        ):
            raise IntegrityError(
                f"variant {v} ({rec.file}): its recorded sha256/size disagree with the file's; {rebuild}"
            )
    return m


def read_checked_contract(folder: str | os.PathLike, m: Manifest | None = None) -> Contract:
    """contract.json, parsed and type-checked; CacheError when it is not one this code reads."""
    folder = Path(folder)
    hint = rebuild_hint(m, _name_for_hint(folder)) if m is not None else "rebuild it"
    try:
        raw = json.loads((folder / CONTRACT_FILE).read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        raise CacheError(f"{folder / CONTRACT_FILE} is missing; {hint}") from None
    except Exception as e:  # noqa: BLE001 - any parse failure is corruption
        raise CacheError(f"{folder / CONTRACT_FILE} is corrupted ({' '.join(str(e).split())[:200]}); {hint}") from None
    version = raw.get("schema_version", SCHEMA_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise CacheError(
            f"{folder / CONTRACT_FILE} has schema_version {version!r}, which this dejavuu-build does not "
            f"read (it reads 1 to {SCHEMA_VERSION}); {hint}"
        )
    try:
        c = Contract.from_json(raw)
        for f in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"):
            v = getattr(c, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{f} is {v!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in c.eos_token_ids):
            raise ValueError("eos_token_ids are not token ids")
    except Exception as e:  # noqa: BLE001
        raise CacheError(f"{folder / CONTRACT_FILE} is corrupted ({' '.join(str(e).split())[:200]}); {hint}") from None
    return c


def check_batched_graph(inputs: Iterable, contract: Contract, path: str | os.PathLike, hint: str) -> None:
    """Refuse a graph recorded as a variant's serving batch graph that does not take the batch
    inputs (schema.batched_inputs) -- for a rowwise variant, whose batched graph takes the same
    names, a batch dimension on its primary input (the plain graph's is 1): the server would fail,
    or silently decode one request, on its first batch. ``inputs``: onnxruntime's NodeArgs (name,
    shape)."""
    inputs = list(inputs)
    missing = batched_inputs(contract) - {i.name for i in inputs}
    if not missing and contract.kv_layout == KV_ROWWISE:
        primary = next((i for i in inputs if i.name == contract.primary_input), None)
        if primary is None or not primary.shape or primary.shape[0] == 1:
            missing = {f"a batch dimension on {contract.primary_input}"}
    if missing:
        raise IntegrityError(
            f"{path} is recorded as the serving batch graph but is not one (it takes no "
            f"{', '.join(sorted(missing))}); {hint}"
        )


def rebuild_hint(m: Manifest, name: str) -> str:
    cmd = {KIND_DATASTORE: "datastore", KIND_VLM: "vlm"}.get(m.kind, "tree-decoder")  # the commands
    return f"rebuild it with `dejavuu-build {cmd} --name {name} --force`"
