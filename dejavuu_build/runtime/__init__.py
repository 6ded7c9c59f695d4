"""The torch-free runtime: onnxruntime, numpy and tokenizers only.

from dejavuu_build.runtime import load
model = load("smollm2-135m")
out = model.generate("def add(a, b):", method="pld", tree=True, max_new_tokens=128)

`load`, `Model`, `GenerationResult` and `DecodeSettings` (runtime.settings) are imported on first
use (PEP 562 `__getattr__`), so importing one part of the runtime (`runtime.session`, `runtime.tree`,
...), as the build does, runs neither `runtime.model` nor the drafters it imports, and this file
does not put them in the build's cache key (`cache.import_closure` reads import statements from the
source; the import below is by name, and `tests/test_imports.py` checks that no module the build
imports takes one of these names from here, where the closure could not follow it).
"""

from __future__ import annotations

import importlib
from typing import Any

# exported name -> the module of this package that defines it
LAZY = {"load": "model", "Model": "model", "GenerationResult": "model", "DecodeSettings": "settings"}

__all__ = ["load", "Model", "GenerationResult", "DecodeSettings"]


def __getattr__(name: str) -> Any:
    if name in LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY))
