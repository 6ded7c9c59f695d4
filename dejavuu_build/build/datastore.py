"""`dejavuu-build datastore`: tokenize a corpus into a token datastore, atomically, with a manifest."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from pathlib import Path

from .. import schema as S
from ..cache import (
    build_lock,
    check_name,
    check_replace,
    commit,
    entry_dir,
    no_manifest,
    read_entry,
    record_files,
    staging,
    verify_entry,
)
from ..errors import CacheError, DejavuuError
from ..log import logger, step


def build_datastore(src: str, tokenizer: str, name: str, *, force: bool = False) -> Path:
    """Build datastore ``name`` from ``src`` with ``tokenizer``'s tokenizer.

    An identical existing datastore (same corpus bytes, same tokenizer.json) is a cache hit; a
    different one is replaced only with ``force``; an entry of another kind (a decoder build) or
    a folder that is not an entry (bench results) is never replaced. A corpus that is not UTF-8,
    has a line that is not JSON or holds no text is refused before anything is written."""
    from ..runtime.model import is_ours, resolve_folder
    from ..runtime.tokenizer import TextTokenizer

    check_name(name)
    path = Path(src)
    if not path.is_file():
        raise DejavuuError(f"{src} not found: pass a .jsonl or .txt file with --from")
    if path.suffix not in (".jsonl", ".txt"):
        raise DejavuuError(f"{src}: the datastore reads .jsonl or .txt files")
    folder, _ = resolve_folder(tokenizer)

    def read_tokenizer(f: Path):
        """The tokenizer the datastore is keyed on, checked against its entry's manifest first."""
        if (f / S.MANIFEST_FILE).is_file():
            verify_entry(f, files=[S.TOKENIZER_FILE])
        elif is_ours(f, tokenizer):
            raise no_manifest(f)
        return TextTokenizer(f), S.sha256_file(f / S.TOKENIZER_FILE)

    tok, tok_digest = read_entry(folder, read_tokenizer)
    digest = S.sha256_file(path)
    key = hashlib.sha256(
        json.dumps({"kind": S.KIND_DATASTORE, "source": digest, "tokenizer": tok_digest}, sort_keys=True).encode()
    ).hexdigest()[:32]
    final = entry_dir(name)
    try:
        with build_lock(name):
            if check_replace(name, S.KIND_DATASTORE, force=force, key=key) is not None:
                logger.info("✓ cache hit: %s is up to date (use --force to rebuild)", final)
                return final
            with staging(name) as tmp:
                with step(f"tokenize {path.name}"):
                    ds = _tokenize(path, tok)
                    ds.save(tmp)
                m = S.Manifest(
                    name=name,
                    kind=S.KIND_DATASTORE,
                    cache_key=key,
                    created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    build_config={
                        "from": str(path.resolve()),
                        "tokenizer": tokenizer,
                        "tokenizer_folder": str(folder),
                        "tokenizer_sha256": tok_digest,
                    },
                    source={"kind": "file", "id": str(path), "sha256": digest},
                )
                record_files(tmp, m)
                S.write_json(tmp / S.MANIFEST_FILE, m.to_json())
                return commit(tmp, name)
    except OSError as e:
        raise CacheError(
            f"could not write datastore {name} under {final.parent} ({e.strerror or type(e).__name__}): "
            f"free disk space or make the cache writable; nothing was replaced"
        ) from None


def _tokenize(path: Path, tok):
    """The corpus as a Datastore, or one line naming what is wrong with the file."""
    from ..runtime.drafters.datastore import build_from_file

    try:
        ds = build_from_file(path, lambda text: tok.encode(text, add_special_tokens=False))
    except UnicodeDecodeError as e:
        raise DejavuuError(
            f"{path} is not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} where a character "
            f"should start): save it as UTF-8"
        ) from None
    except ValueError as e:  # read_documents names the file and line
        raise DejavuuError(f"{' '.join(str(e).split())[:300]}: fix or remove that line") from None
    if ds.n_tokens == 0:
        raise DejavuuError(
            f"{path} holds no text to index (a .jsonl needs rows with a turns, text or prompt field, "
            f"a .txt non-blank paragraphs): nothing was built"
        )
    return ds
