"""`dejavuu-build datastore`: tokenize a corpus into a token datastore, atomically, with a manifest."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from .. import schema as S
from ..cache import build_lock, commit, entry_dir, record_files, staging
from ..errors import DejavuuError
from ..log import step


def build_datastore(src: str, tokenizer: str, name: str, *, force: bool = False) -> Path:
    from ..runtime.drafters.datastore import build_from_file
    from ..runtime.model import resolve_folder
    from ..runtime.tokenizer import TextTokenizer

    path = Path(src)
    if not path.is_file():
        raise DejavuuError(f"{src} not found: pass a .jsonl or .txt file with --from")
    if path.suffix not in (".jsonl", ".txt"):
        raise DejavuuError(f"{src}: the datastore reads .jsonl or .txt files")
    folder, _ = resolve_folder(tokenizer)
    tok = TextTokenizer(folder)
    digest = S.sha256_file(path)
    final = entry_dir(name)
    with build_lock(name):
        if not force and (final / S.MANIFEST_FILE).is_file():
            old = S.read_manifest(final)
            if old.kind == "datastore" and old.source.get("sha256") == digest and old.build_config.get("tokenizer_folder") == str(folder):
                return final
        with staging(name) as tmp:
            with step(f"tokenize {path.name}"):
                ds = build_from_file(path, lambda text: tok.encode(text, add_special_tokens=False))
                ds.save(tmp)
            m = S.Manifest(name=name, kind="datastore",
                           created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           build_config={"from": str(path.resolve()), "tokenizer": tokenizer,
                                         "tokenizer_folder": str(folder)},
                           source={"kind": "file", "id": str(path), "sha256": digest})
            record_files(tmp, m)
            S.write_json(tmp / S.MANIFEST_FILE, m.to_json())
            return commit(tmp, name)
