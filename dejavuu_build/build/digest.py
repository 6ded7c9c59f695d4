"""sha256 of the build folder's files, hashed once per version of each: the byte-identity check,
the calibration key, the serving graph's record and the manifest all ask for the same digests."""

from __future__ import annotations

from pathlib import Path

from .. import schema as S

_hashed: dict[tuple, str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, hashed once per version of it (path, inode, size, mtime)."""
    st = path.stat()
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _hashed:
        _hashed[key] = S.sha256_file(path)
    return _hashed[key]
