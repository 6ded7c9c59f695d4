"""Training-free drafters for speculative decoding, registered by name.

``make_drafter(name, datastore=..., **params)`` builds one; ``METHODS`` lists the names.
See ``docs/methods.md`` for when each method wins. The contract lives in ``base.py``.
"""

from __future__ import annotations

from pathlib import Path

# Importing the method modules registers them; their order is the order of METHODS.
from . import lookup  # noqa: F401  isort: skip
from . import lookahead  # noqa: F401  isort: skip
from . import token_recycling  # noqa: F401  isort: skip
from . import suffix  # noqa: F401  isort: skip
from . import auto  # noqa: F401  isort: skip
from .base import Draft, DraftBudget, Drafter, Feedback
from .datastore import Datastore, build_from_file
from .history import REGISTRY
from .suffix_index import SuffixIndex

METHODS: tuple[str, ...] = tuple(REGISTRY)


def make_drafter(name: str, *, datastore: Datastore | str | Path | None = None, **params) -> Drafter:
    """Construct the drafter registered as ``name``.

    ``datastore`` (a :class:`Datastore` or a directory saved by :meth:`Datastore.save`) goes
    to the methods that retrieve from one (``rest``, ``sam_decoding``, ``asam*``, and
    ``auto`` for its members) and is ignored by the others; ``params`` go to the constructor.
    """
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown drafter {name!r}; valid names: {', '.join(METHODS)}")
    if getattr(cls, "uses_datastore", False):
        params["datastore"] = datastore
    return cls(**params)


__all__ = [
    "METHODS",
    "make_drafter",
    "Draft",
    "DraftBudget",
    "Drafter",
    "Feedback",
    "Datastore",
    "build_from_file",
    "SuffixIndex",
]
