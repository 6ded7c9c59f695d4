"""One owner for names: the KV layouts, mask kinds, precisions and the cache's file and folder
names are spelled in dejavuu_build/schema.py only (the precisions' names in their table,
dejavuu_build/precisions.py, which schema re-exports); every writer and reader imports them from there."""

from __future__ import annotations

import ast
from pathlib import Path

from dejavuu_build import schema as S

PACKAGE = Path(S.__file__).parent
OWNED = {
    S.KV_CONCAT,
    S.KV_STATIC,
    S.KV_ROWWISE,
    S.STATIC_SUFFIX,
    S.ROWWISE_SUFFIX,
    S.MASK_ADDITIVE_4D,
    S.MASK_PADDING_2D,
    S.CONTRACT_FILE,
    S.MANIFEST_FILE,
    S.REFERENCE_FILE,
    S.EMBED_FILE,
    S.VISION_FILE,
    S.VLM_FILE,
    S.PREPROCESSOR_FILE,
    S.TOKENIZER_FILE,
    S.TOKENIZER_CONFIG_FILE,
    S.CHAT_TEMPLATE_FILE,
    S.GENERATION_CONFIG_FILE,
    S.DATASTORE_TOKENS_FILE,
    S.DATASTORE_SUFFIXES_FILE,
    S.DATASTORE_FILE,
    S.STAGING_DIR,
    S.LOCKS_DIR,
    S.SOURCES_DIR,
    S.SOURCE_FILE,
    S.RUNTIME_DIR,
    S.PEERS_DIR,
    S.PEER_FILE,
    S.FP32,
    S.INT8,
    S.INT4,
}
# files that own some of these names besides schema.py: the precisions table owns its names
OWNERS = {"precisions.py": {S.FP32, S.INT8, S.INT4}}


def test_shared_names_are_spelled_in_schema_only():
    spelled: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "schema.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            owned = OWNED - OWNERS.get(rel, set())
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in owned:
                spelled.setdefault(rel, set()).add(node.value)
    extra = {rel: sorted(v) for rel, v in spelled.items()}
    assert {rel: v for rel, v in extra.items() if v} == {}, "import these names from dejavuu_build.schema"
