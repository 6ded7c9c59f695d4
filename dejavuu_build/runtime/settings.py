"""Decode settings: one validated value per request, built once where a request comes in.

A :class:`DecodeSettings` holds everything that decides how one request decodes (method, tree
and its draft budget, max tokens, sampling, stop strings). Each entry point builds one and passes
it down: `dejavuu-build generate` from its options (runtime.cli), ``Model.generate`` /
``Model.stream`` from their keyword arguments (or take one as ``settings=``), the server from a
request's JSON body over its own defaults (serve.app, from serve.server's ServeConfig), the bench
from its BenchConfig. Below the entry points nothing checks a setting again: ``Model.plan`` and the
server's scheduler read the fields.

Building one checks it (``__post_init__``, also through ``dataclasses.replace``): a bad value is a
:class:`SettingsError` (a GenerationError, so one line and exit 2 on the CLI, HTTP 400 on the
server) whose message names the setting and says what it takes, and whose ``field`` names it for
the server's ``param``. A new setting is one field here, its check in ``__post_init__``, and the
code that reads it (plus its CLI option and request field where it is exposed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

import numpy as np

from .. import schema as S
from ..errors import GenerationError
from .drafters import METHODS
from .drafters.base import Drafter
from .sampling import Sampler
from .stops import as_list

# a method by name that no registry entry builds: the draft model (``draft_model=NAME``) drafts
DRAFT_MODEL = "draft_model"


class SettingsError(GenerationError):
    """A decode setting that would answer with garbage, loop or fail later; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class DecodeSettings:
    """How one request decodes. Every field has the default ``Model.generate`` has.

    ``stop`` takes one string, several or None, and is kept as a tuple; ``method`` is a registered
    method's name (``runtime.drafters.METHODS``), ``draft_model``, or a Drafter object (the bench's,
    the server's memory-backed ones). ``width``, ``max_depth`` and ``max_nodes`` bound each step's
    draft (``max_nodes`` None: 16 nodes for a tree, ``max_depth`` for a chain)."""

    method: str | Drafter = "baseline"
    tree: bool = False
    max_new_tokens: int = S.DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: Sequence[str] = ()
    width: int = S.DEFAULT_TREE_WIDTH
    max_depth: int = S.DEFAULT_MAX_DEPTH
    max_nodes: int | None = None

    def __post_init__(self) -> None:
        """Refuse settings that would answer with garbage or loop, with one line that says what to do
        (the first bad one, in a fixed order: sampling, draft budget, max_new_tokens, stop, method)."""
        t, p, k, seed = self.temperature, self.top_p, self.top_k, self.seed
        if not _number(t) or not math.isfinite(t) or t < 0:
            raise SettingsError("temperature", f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _number(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise SettingsError("top_p", f"top_p must be in (0, 1], got {p!r}")
        if not _integer(k) or k < 0:
            raise SettingsError("top_k", f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not _integer(seed) or seed < 0:
            raise SettingsError("seed", f"seed must be an integer >= 0, got {seed!r}")
        for name in ("width", "max_depth", "max_new_tokens"):
            v = getattr(self, name)
            if not _integer(v) or v < 1:
                raise SettingsError(name, f"{name} must be an integer >= 1, got {v!r}")
        n = self.max_nodes
        if n is not None and (not _integer(n) or n < 1):
            raise SettingsError("max_nodes", f"max_nodes must be an integer >= 1, got {n!r}")
        try:
            stop = tuple(as_list(self.stop))
        except GenerationError as e:
            raise SettingsError("stop", str(e)) from None
        for s in stop:
            if not isinstance(s, str) or not s:
                raise SettingsError("stop", f"stop strings must be non-empty text, got {s!r}")
        object.__setattr__(self, "stop", stop)
        m = self.method
        if not isinstance(m, Drafter) and m not in METHODS and m != DRAFT_MODEL:
            raise SettingsError("method", f"unknown method {m!r}; choose one of: {', '.join(METHODS)}, {DRAFT_MODEL}")
        object.__setattr__(self, "tree", bool(self.tree))

    # ------------------------------------------------------------------ building
    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names: the keyword arguments ``Model.generate`` takes for them."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def split(cls, kw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the settings among keyword arguments ``kw``, the rest)."""
        names = cls.names()
        return {k: v for k, v in kw.items() if k in names}, {k: v for k, v in kw.items() if k not in names}

    @classmethod
    def given(cls, settings: DecodeSettings | None, loose: Mapping[str, Any]) -> DecodeSettings:
        """``settings``, or one built from keyword arguments ``loose``: an entry point that takes
        both (``Model.generate``) refuses a call that passes both, which would lose one of them."""
        if settings is None:
            return cls(**loose)
        if not isinstance(settings, DecodeSettings):
            raise SettingsError(
                "settings", f"settings must be a DecodeSettings, got {str(repr(settings))[:40]}: or pass keywords"
            )
        built, default = cls(**loose), cls()
        if both := [k for k in cls.names() if getattr(built, k) != getattr(default, k)]:
            raise SettingsError(
                "settings",
                f"pass decode settings as settings=DecodeSettings(...) or as keywords, not both "
                f"(got settings= and {', '.join(both)})",
            )
        return settings

    # ------------------------------------------------------------------ reading
    @property
    def method_name(self) -> str:
        """The method's name (a Drafter object's ``name``, else "custom")."""
        m = self.method
        return m if isinstance(m, str) else getattr(m, "name", "custom")

    @property
    def sampler(self) -> Sampler:
        return Sampler(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
