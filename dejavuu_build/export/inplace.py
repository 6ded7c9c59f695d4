"""Transitional: the in-place KV passes live in export.passes.static_kv and export.passes.rowwise_kv."""

# transitional: build/ still imports these from here; removed when build/ is updated
from .passes.rowwise_kv import to_rowwise_kv  # noqa: F401
from .passes.static_kv import to_static_kv  # noqa: F401
