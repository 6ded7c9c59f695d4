"""The KV layouts' registry: one module per layout (concat, static, rowwise), each defining its
``LAYOUT`` (layouts.base.Layout): its graph pass, its step line, its place in the default's
preference, its capacity rule, its row-guard rule, the serving batch graph a default of it gets,
and the drivers that feed its graphs -- for one request (``Layout.driver``: the runtime's
Decoder, and through it the build's gates and timings) and batched (``Layout.batch_driver``:
the server). Everything that drives a graph looks its layout up here (``LAYOUTS``); the build
reads the rest (build.variants, build.row_guard, build.default, build.serve_graph).

A layout's name and file suffix are the file format's (schema: KV_CONCAT, KV_STATIC, KV_ROWWISE,
LAYOUT_SUFFIXES, what graphs and manifests carry): the modules read them from there, so that the
export passes, which read schema too, import nothing of these (no circle).
"""

from __future__ import annotations

from .. import schema as S
from . import concat, rowwise, static
from .base import BatchDriver, BatchUnavailable, Cache, Driver, Layout, Rows, capacity

__all__ = [
    "LAYOUTS",
    "PREFERRED_LAYOUTS",
    "BATCHED_LAYOUTS",
    "DERIVED_LAYOUTS",
    "BatchDriver",
    "BatchUnavailable",
    "Cache",
    "Driver",
    "Layout",
    "Rows",
    "capacity",
]

LAYOUTS: dict[str, Layout] = {m.LAYOUT.name: m.LAYOUT for m in (concat, static, rowwise)}
assert set(LAYOUTS) == set(S.KV_LAYOUTS), "every layout of the schema is registered"

# Layout preference at equal precision: static first -- a lone token one row (its attention floor),
# exact trees, the cheapest verify rows and prefill of the three (SmolLM2 int4, Xeon AVX-512 + AMX,
# 2 threads, past 256: 1/2/4/8 rows 1.01/0.94/0.89/0.88x rowwise's, time to first token 0.85x; rowwise
# verifies chains only, concat also copies its cache); timing can still displace it (build.default).
PREFERRED_LAYOUTS = tuple(sorted(LAYOUTS, key=lambda k: LAYOUTS[k].rank))
# The layouts with a batched serving graph (serve.batch opens it), in the preference's order.
BATCHED_LAYOUTS = tuple(k for k in PREFERRED_LAYOUTS if LAYOUTS[k].batch_pass is not None)
# The layouts written from the export by a graph pass, in the schema's order.
DERIVED_LAYOUTS = tuple(k for k in S.KV_LAYOUTS if LAYOUTS[k].in_place)
