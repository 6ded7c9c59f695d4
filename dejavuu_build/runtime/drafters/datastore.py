"""A static retrieval datastore: documents as one flat token array plus its suffix index.

On disk (one directory, written in place; the caller makes it atomic by renaming)::

    tokens.npy       int32 [n_tokens]   documents, each followed by SEP (-1)
    suffixes.npy     int64 [n_sorted]   suffix start positions in key order (SuffixIndex)
    datastore.json   {"format", "version", "n_docs", "n_tokens", "n_sorted", "max_len", "sep"}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ...rows import json_row
from ...schema import DATASTORE_FILE, DATASTORE_SUFFIXES_FILE, DATASTORE_TOKENS_FILE
from .suffix_index import SEP, SuffixIndex

FORMAT = "dejavuu-drafter-datastore"
VERSION = 1


class Datastore:
    """Token documents indexed for longest-suffix retrieval (``rest``, ``sam_decoding``, ``asam``)."""

    def __init__(self, index: SuffixIndex, n_docs: int):
        self.index = index
        self.n_docs = n_docs

    @classmethod
    def build(cls, token_lists: Iterable[Sequence[int]], max_len: int = 32) -> "Datastore":
        """Index documents (lists of non-negative token ids); empty ones are skipped."""
        flat: list[int] = []
        n_docs = 0
        for doc in token_lists:
            doc = [int(t) for t in doc]
            if not doc:
                continue
            if min(doc) < 0:
                raise ValueError("token ids must be non-negative (negative ids separate documents)")
            flat.extend(doc)
            flat.append(SEP)
            n_docs += 1
        return cls(SuffixIndex(flat, max_len=max_len), n_docs)

    @property
    def n_tokens(self) -> int:
        return len(self.index)

    @property
    def tokens(self) -> np.ndarray:
        return np.asarray(self.index.tokens, np.int32)

    def __repr__(self) -> str:
        return f"Datastore(n_docs={self.n_docs}, n_tokens={self.n_tokens}, max_len={self.index.max_len})"

    def save(self, directory: str | Path) -> Path:
        """Write the arrays and ``datastore.json`` into ``directory`` (created if missing)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        sa = self.index.sorted_positions()
        np.save(out / DATASTORE_TOKENS_FILE, self.tokens)
        np.save(out / DATASTORE_SUFFIXES_FILE, sa)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "n_docs": self.n_docs,
            "n_tokens": self.n_tokens,
            "n_sorted": int(len(sa)),
            "max_len": self.index.max_len,
            "sep": SEP,
        }
        (out / DATASTORE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | Path) -> "Datastore":
        src = Path(directory)
        meta_path = src / DATASTORE_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} not found: not a drafter datastore")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(
                f"{src}: unsupported datastore format {meta.get('format')!r} "
                f"version {meta.get('version')!r} (expected {FORMAT!r} {VERSION})"
            )
        tokens = np.load(src / DATASTORE_TOKENS_FILE)
        sa = np.load(src / DATASTORE_SUFFIXES_FILE)
        if len(tokens) != meta["n_tokens"] or len(sa) != meta["n_sorted"]:
            raise ValueError(f"{src}: array sizes disagree with {DATASTORE_FILE}")
        return cls(SuffixIndex.from_arrays(tokens, sa, meta["max_len"]), int(meta["n_docs"]))


def as_datastore(datastore: "Datastore | str | Path | None") -> Datastore:
    """Accept a Datastore, a saved directory, or None (an empty datastore)."""
    if datastore is None:
        return Datastore.build([])
    if isinstance(datastore, Datastore):
        return datastore
    if isinstance(datastore, (str, Path)):
        return Datastore.load(datastore)
    raise TypeError(f"expected a Datastore, a directory or None, got {type(datastore).__name__}")


def _texts(value) -> Iterator[str]:
    """Strings inside a field: a string, a list of strings, or chat turns as dicts."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict):
                item = next((item[k] for k in ("content", "value", "text") if isinstance(item.get(k), str)), None)
            if isinstance(item, str):
                yield item


def read_documents(path: str | Path, text_fields: Sequence[str] = ("turns", "text", "prompt")) -> Iterator[str]:
    """Documents in a ``.jsonl`` file (each string under ``text_fields`` of each row, e.g.
    each Spec-Bench turn) or a ``.txt`` file (blank-line-separated paragraphs)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json_row(line, f"{path}:{line_no}")  # ValueError naming the line
                for field in text_fields:
                    if isinstance(row, dict) and field in row:
                        yield from (t for t in _texts(row[field]) if t.strip())
    elif path.suffix == ".txt":
        paragraph: list[str] = []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    paragraph.append(line)
                elif paragraph:
                    yield "".join(paragraph).strip()
                    paragraph = []
        if paragraph:
            yield "".join(paragraph).strip()
    else:
        raise ValueError(f"{path}: unsupported datastore source (use .jsonl or .txt)")


def build_from_file(
    path: str | Path,
    encode: Callable[[str], list[int]],
    text_fields: Sequence[str] = ("turns", "text", "prompt"),
    max_len: int = 32,
) -> Datastore:
    """Tokenize every document of ``path`` with ``encode`` and index them."""
    return Datastore.build((encode(doc) for doc in read_documents(path, text_fields)), max_len=max_len)
