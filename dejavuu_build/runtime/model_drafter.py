"""A decoder from the cache drafting for another: real draft probabilities for speculative sampling.

Typical use: the int4 build of a model drafting for its fp32 or int8 build (same tokenizer).
The drafter keeps its own KV cache of the committed context, re-syncs it by longest common
prefix each step, and drafts a chain autoregressively, recording q for each drafted token so
the engine can accept with min(1, p/q) and resample from the residual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from ..errors import GenerationError
from ..layouts import Cache
from .drafters.base import Draft, DraftBudget, Drafter
from .sampling import Sampler

if TYPE_CHECKING:
    from .decoder import Decoder


class DraftSource(Protocol):
    """What drafting reads of the draft model: its decoder. A loaded ``runtime.Model`` is one (this
    module does not import it: the model builds its draft model's drafter from here)."""

    decoder: Decoder


class ModelDrafter(Drafter):
    """Drafts with a (smaller or lower-precision) decoder. Wins when the draft model agrees with
    the target often and costs far less per token; loses when its per-token cost approaches the
    target's verify cost (on CPU, an int4 draft for an int8 target of the same size rarely pays)."""

    name = "draft_model"

    def __init__(
        self,
        model: DraftSource,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        max_draft: int = 4,
    ):
        self.m = model
        self.dec = model.decoder
        self.sampler = Sampler(temperature, top_p, top_k, seed + 7919)
        self.max_draft = max_draft
        self.kv: Cache | None = None  # made by begin()
        self.cached: list[int] = []

    def begin(self, prompt_ids: Sequence[int]) -> None:
        self.kv = self.dec.new_cache()
        self.cached = []

    def _cache(self) -> Cache:
        if self.kv is None:
            raise GenerationError("ModelDrafter.propose before begin(): start the request first")
        return self.kv

    def _feed(self, toks: list[int]) -> np.ndarray:
        kv = self._cache()
        logits, _, present = self.dec.forward(toks, None, kv)
        kv.commit(present, len(toks), list(range(len(toks))))
        self.cached += toks
        return logits[-1]

    def propose(self, context: Sequence[int], budget: DraftBudget) -> Draft:
        ctx = list(context)
        n = 0
        lim = min(len(self.cached), len(ctx) - 1)
        while n < lim and self.cached[n] == ctx[n]:
            n += 1
        self._cache().truncate(n)
        self.cached = self.cached[:n]
        logits = self._feed(ctx[n:])
        toks, probs = [], []
        for i in range(min(self.max_draft, budget.max_depth, budget.max_nodes)):
            q = self.sampler.probs(logits)
            t = int(np.argmax(q)) if self.sampler.greedy else self.sampler.draw(q, len(ctx) + i)
            toks.append(t)
            probs.append(q)
            if i + 1 < min(self.max_draft, budget.max_depth, budget.max_nodes):
                logits = self._feed([t])
        return Draft(toks, list(range(-1, len(toks) - 1)), probs)
