"""Training-free drafters for speculative decoding, registered by name.

``make_drafter(name, datastore=..., **params)`` builds one; ``METHODS`` lists the names.
See ``docs/methods.md`` for when each method wins. The contract lives in ``base.py``.
"""

from __future__ import annotations

# Importing the method modules registers them; their order is the order of METHODS.
from . import lookup  # noqa: F401  isort: skip
from . import lookahead  # noqa: F401  isort: skip
from . import token_recycling  # noqa: F401  isort: skip
from . import suffix  # noqa: F401  isort: skip
from . import vote  # noqa: F401  isort: skip
from . import auto  # noqa: F401  isort: skip
from .base import Draft, DraftBudget, Drafter, Feedback
from .datastore import Datastore, build_from_file
from .history import REGISTRY, make_drafter
from .suffix_index import SuffixIndex

METHODS: tuple[str, ...] = tuple(REGISTRY)


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
