"""Plumbing shared by the drafters: the method registry, the request's token history, and a
hidden-state memory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .base import Draft, DraftBudget, Drafter, Feedback
from .sizing import Sizer

if TYPE_CHECKING:
    from .datastore import Datastore

REGISTRY: dict[str, type[Drafter]] = {"baseline": Drafter}


def register(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter constructible by ``make_drafter(name)``."""

    def deco(cls: type[Drafter]) -> type[Drafter]:
        if name in REGISTRY:
            raise ValueError(f"drafter {name!r} registered twice")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return deco


class HistoryDrafter(Drafter):
    """A drafter that mirrors the request's committed tokens and indexes each token once.

    Subclasses implement hooks instead of the lifecycle methods:
    ``_reset`` (a request starts), ``_on_tokens`` (tokens appended to the history: update the
    incremental indices), ``_draft`` (propose from ``self._hist``), ``_learn`` (signals in the
    feedback) and ``_finish`` (request ends). ``propose`` re-syncs with the engine's context, so
    a drafter stays correct even if the engine skips a feedback or rewinds (which restarts it).
    """

    def __init__(self, sizer: Sizer | None = None):
        self.sizer = sizer or Sizer()
        self._hist: list[int] = []
        self.last_draft = Draft()
        self._draft_at = -1
        self.match_len = 0  # how long a match the latest draft came from (0: none, or not a copy)

    # -- lifecycle (the Drafter contract) -----------------------------------------------------

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self._start([int(t) for t in prompt_ids])

    def propose(self, context: Sequence[int], budget: DraftBudget) -> Draft:
        self._sync(context)
        draft = Draft()
        self.match_len = 0
        if self._hist and budget.max_nodes > 0 and budget.max_depth > 0:
            draft = self._draft(budget)
        self.observe_verified(draft)
        return draft

    def feedback(self, fb: Feedback) -> None:
        start = len(self._hist)
        verified = self.last_draft if self._draft_at == start else Draft()
        self._extend([int(t) for t in fb.committed])
        self._learn(fb, start, verified)
        self.sizer.learn(fb, verified)

    def end(self) -> None:
        self._finish()

    def sync(self, context: Sequence[int]) -> None:
        """Catch up with the engine's context without drafting (``auto``'s members it did not ask)."""
        self._sync(context)

    def observe_verified(self, draft: Draft) -> None:
        """Record the draft the engine is verifying now (``auto`` sets it to another member's)."""
        self.last_draft = draft
        self._draft_at = len(self._hist)

    # -- history --------------------------------------------------------------------------

    def _start(self, tokens: list[int]) -> None:
        self._hist = []
        self._draft_at = -1
        self._reset()
        self._extend(tokens)

    def _extend(self, tokens: list[int]) -> None:
        if tokens:
            self._hist.extend(tokens)
            self._on_tokens(tokens)

    def _sync(self, context: Sequence[int]) -> None:
        n, h = len(context), self._hist
        m = len(h)
        if n == m and (m == 0 or int(context[-1]) == h[-1]):
            return
        if n > m and (m == 0 or int(context[m - 1]) == h[-1]):
            self._extend([int(t) for t in context[m:]])
            return
        self._start([int(t) for t in context])  # the engine rewound or switched request

    # -- hooks ----------------------------------------------------------------------------

    def _reset(self) -> None:
        """A request starts: clear per-request state."""

    def _on_tokens(self, tokens: list[int]) -> None:
        """``tokens`` were appended to ``self._hist``."""

    def _draft(self, budget: DraftBudget) -> Draft:
        return Draft()

    def _learn(self, fb: Feedback, start: int, verified: Draft) -> None:
        """``fb.committed`` now sits at ``self._hist[start:]``; ``verified`` is the draft checked."""

    def _finish(self) -> None:
        """The request ended."""


class HiddenStore:
    """Hidden states by context position, randomly projected to ``dim`` and unit-normalised.

    A fixed Gaussian projection keeps cosine similarities (Johnson-Lindenstrauss) while making
    a look-up over thousands of positions a ``[n, 64]`` product instead of ``[n, 4096]``.
    """

    def __init__(self, dim: int = 64, seed: int = 0):
        self.dim, self.seed = dim, seed
        self._proj: np.ndarray | None = None
        self._vec = np.zeros((0, dim), np.float32)
        self._has = np.zeros(0, bool)
        self.latest = -1

    def clear(self) -> None:
        self._vec[:] = 0
        self._has[:] = False
        self.latest = -1

    def _project(self, hidden: np.ndarray) -> np.ndarray:
        h = np.asarray(hidden, np.float32).reshape(len(hidden), -1)
        if self._proj is None or self._proj.shape[0] != h.shape[1]:
            if h.shape[1] <= self.dim:
                self._proj = np.eye(h.shape[1], self.dim, dtype=np.float32)
            else:
                rng = np.random.default_rng(self.seed)
                self._proj = rng.standard_normal((h.shape[1], self.dim)).astype(np.float32)
        v = h @ self._proj
        norms = np.linalg.norm(v, axis=1, keepdims=True)
        return v / np.maximum(norms, 1e-12)

    def put(self, last_pos: int, hidden: np.ndarray) -> None:
        """Store rows for positions ``last_pos - len(hidden) + 1 .. last_pos``."""
        if hidden is None or len(hidden) == 0 or last_pos < 0:
            return
        v = self._project(hidden)
        first = last_pos - len(v) + 1
        if first < 0:
            v, first = v[-first:], 0
        if last_pos >= len(self._has):
            cap = max(2 * len(self._has), last_pos + 1, 256)
            vec = np.zeros((cap, self.dim), np.float32)
            vec[: len(self._vec)] = self._vec
            has = np.zeros(cap, bool)
            has[: len(self._has)] = self._has
            self._vec, self._has = vec, has
        self._vec[first : last_pos + 1] = v
        self._has[first : last_pos + 1] = True
        self.latest = max(self.latest, last_pos)

    def cosine(self, positions: Sequence[int]) -> np.ndarray:
        """Cosine of each position's state with the latest one; NaN where nothing is stored."""
        pos = np.asarray(positions, np.int64)
        out = np.full(len(pos), np.nan, np.float32)
        if self.latest < 0 or not len(pos):
            return out
        ok = (pos >= 0) & (pos < len(self._has))
        ok[ok] = self._has[pos[ok]]
        out[ok] = self._vec[pos[ok]] @ self._vec[self.latest]
        return out

    def nearest(self, k: int, before: int, min_cosine: float) -> list[int]:
        """Up to ``k`` stored positions ``< before`` most similar to the latest, best first."""
        if self.latest < 0 or k <= 0:
            return []
        stop = min(before, len(self._has))
        if stop <= 0:
            return []
        sims = self._vec[:stop] @ self._vec[self.latest]
        sims[~self._has[:stop]] = -np.inf
        k = min(k, stop)
        top = np.argpartition(-sims, k - 1)[:k]
        top = top[np.argsort(-sims[top], kind="stable")]
        return [int(p) for p in top if sims[p] >= min_cosine]


def make_drafter(name: str, *, datastore: Datastore | str | Path | None = None, **params) -> Drafter:
    """Construct the drafter registered as ``name``.

    ``datastore`` (a :class:`Datastore` or a directory saved by :meth:`Datastore.save`) goes
    to the methods that retrieve from one (``rest``, ``sam_decoding``, ``asam*``, and
    ``auto`` for its members) and is ignored by the others; ``params`` go to the constructor.
    The registry is complete whenever this runs: the drafters package's ``__init__`` imports (so
    registers) every method before any of its modules is used.
    """
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown drafter {name!r}; valid names: {', '.join(REGISTRY)}")
    if getattr(cls, "uses_datastore", False):
        params["datastore"] = datastore
    return cls(**params)
