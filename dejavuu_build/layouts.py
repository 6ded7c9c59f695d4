"""The KV layouts' registry: per layout, what the build does with it -- its graph pass, its step
line, its place in the default's preference order, its capacity rule, its row-guard rule and the
serving batch graph a default of it gets -- in one table (``LAYOUTS``), read by the build
(build.variants, build.row_guard, build.default, build.serve_graph).

A layout's name and file suffix are the file format's (schema: KV_CONCAT, KV_STATIC, KV_ROWWISE,
LAYOUT_SUFFIXES, what graphs and manifests carry): this module reads them from there, so that
the export passes, which read schema too, import nothing of this one (no circle). The runtime's
feeds for a layout are runtime.decoder + runtime.kv; the server's are serve.batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import schema as S


# The passes, imported when run (onnx and the passes load only for a build that writes a layout).
def _static_kv(proto: Any, capacity: int) -> Any:
    from .export.passes.static_kv import to_static_kv

    return to_static_kv(proto, capacity)


def _rowwise_kv(proto: Any, capacity: int) -> Any:
    from .export.passes.rowwise_kv import to_rowwise_kv

    return to_rowwise_kv(proto, capacity)


def _static_batch(proto: Any, source: str) -> Any:
    from .export.passes.serve_batch import to_serve_batch

    return to_serve_batch(proto, source)


def _rowwise_batch(proto: Any, source: str) -> Any:
    from .export.passes.serve_batch_rowwise import to_serve_batch_rowwise

    return to_serve_batch_rowwise(proto, source)


@dataclass(frozen=True)
class Layout:
    """One KV layout as the build knows it."""

    name: str  # schema.KV_*: the string graphs (schema.KV_LAYOUT_KEY) and manifests carry
    rank: int  # preference at equal precision for the default (0 first; timing may still displace it)
    in_place: bool  # a bound buffer of `capacity` positions (capacity()), written where the step says
    step: str = ""  # the build's step line for its graph pass ({p}: precision, {c}: capacity)
    # (concat proto, capacity) -> this layout's graph (ExportError: no such flavour); None: the export itself
    graph_pass: Callable[[Any, int], Any] | None = None
    optional: bool = True  # a graph the pass does not apply to: the build goes on without it (else raises)
    padded: str = ""  # why lone tokens are padded whatever the graph (no row guard); "": probe and guard
    batch: str = S.KV_STATIC  # the layout whose batched serving graph a default of this layout gets
    # (proto of this layout, its name) -> its batched serving graph (ContractError: does not apply)
    batch_pass: Callable[[Any, str], Any] | None = None

    @property
    def suffix(self) -> str:
        return S.LAYOUT_SUFFIXES.get(self.name, "")


LAYOUTS: dict[str, Layout] = {
    # present = past + new: the exported graph, what other runtimes load; copies its cache each step
    S.KV_CONCAT: Layout(S.KV_CONCAT, rank=2, in_place=False),
    # GroupQueryAttention over one bound buffer: its lone row differs from its multi-row one
    # whatever the pad, so the runtime pads a lone token (a pad row) and no row guard applies
    S.KV_STATIC: Layout(
        S.KV_STATIC,
        rank=1,
        in_place=True,
        step="static KV flavour of {p} (GroupQueryAttention, capacity {c})",
        graph_pass=_static_kv,
        optional=False,
        padded="GroupQueryAttention: lone tokens are padded by the runtime",
        batch_pass=_static_batch,
    ),
    # every query row on one-row kernels: a single token decodes as one row
    S.KV_ROWWISE: Layout(
        S.KV_ROWWISE,
        rank=0,
        in_place=True,
        step="rowwise KV flavour of {p} (one-row attention in place, capacity {c})",
        graph_pass=_rowwise_kv,
        batch=S.KV_ROWWISE,
        batch_pass=_rowwise_batch,
    ),
}
assert set(LAYOUTS) == set(S.KV_LAYOUTS), "every layout of the schema is registered"

# Layout preference at equal precision: rowwise decodes a single token as one row (static pays a
# pad row, concat also copies its cache); timing can still displace it (build.default).
PREFERRED_LAYOUTS = tuple(sorted(LAYOUTS, key=lambda k: LAYOUTS[k].rank))
# The layouts with a batched serving graph (serve.batch opens it), in the preference's order.
BATCHED_LAYOUTS = tuple(k for k in PREFERRED_LAYOUTS if LAYOUTS[k].batch_pass is not None)
# The layouts written from the export by a graph pass, in the schema's order.
DERIVED_LAYOUTS = tuple(k for k in S.KV_LAYOUTS if LAYOUTS[k].in_place)


def layout(name: str) -> Layout:
    return LAYOUTS[name]


def capacity(max_context: int | None, max_positions: int) -> int:
    """An in-place KV buffer's length: --max-context, else the model's limit capped at
    DEFAULT_MAX_CONTEXT (pages are only touched as a context grows; sizes: docs/runtime.md)."""
    if max_context:
        return int(max_context)
    return int(min(max_positions or S.DEFAULT_MAX_CONTEXT, S.DEFAULT_MAX_CONTEXT))
