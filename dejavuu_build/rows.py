"""Rows of the text files users hand the commands (a datastore's corpus, `bench --data`, `inspect
--quality --texts`): each JSON line parsed so that whatever it holds ends as one ValueError naming
the file and line -- not JSON, nested too deeply for any row, or text that is not text (a lone
surrogate such as ``"\\ud800"``, which no tokenizer takes). Pure Python, shared by every side."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # no row of any of these files nests deeper


def json_row(line: str, where: str) -> Any:
    """The JSON value of one line, or ValueError(f"{where}: ...") saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to be a row (more than {MAX_DEPTH} levels)") from None
    stack: list[tuple[Any, int]] = [(row, 0)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: nested too deeply to be a row (more than {MAX_DEPTH} levels)")
        if isinstance(x, str):
            check_text(x, where)
        elif isinstance(x, list):
            stack.extend((v, depth + 1) for v in x)
        elif isinstance(x, dict):
            stack.extend((v, depth + 1) for v in x.values())
            stack.extend((k, depth + 1) for k in x)
    return row


def check_text(text: str, where: str) -> str:
    """``text`` when it encodes as UTF-8; ValueError naming ``where`` for a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where}: holds a lone surrogate ({text[e.start : e.start + 1].encode('unicode_escape').decode()}), "
            f"which is not text"
        ) from None
    return text


def not_utf8(path, e: UnicodeDecodeError) -> str:
    """The line for a file that is not UTF-8 text (a binary file, another encoding)."""
    return (
        f"{path} is not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} where a character should "
        f"start): pass a UTF-8 .jsonl or .txt file"
    )
