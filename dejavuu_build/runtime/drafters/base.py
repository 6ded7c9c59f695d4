"""The drafter contract: what a drafter sees and what it returns.

A drafter is a pure-Python object that proposes draft tokens from token ids only. It never
sees an ONNX session or a tensor library; optional signals (the verifier's top-k ids per
verified node, hidden states of committed tokens) arrive as numpy arrays through
:meth:`Drafter.feedback`. The same instance can drive the text decoder and the
vision-language decoder: both commit plain token ids.

Lifecycle for one request::

    d.begin(prompt_ids)                      # new request (global state may persist)
    while generating:
        draft = d.propose(context, budget)   # context = all committed ids so far
        ... engine verifies ...
        d.feedback(Feedback(...))            # what was accepted, optional signals
    d.end()

A draft is a tree in topological order: ``parents[i]`` is the index of node ``i``'s parent
within the draft, or ``-1`` when the node hangs off the root (the last committed token).
A chain is ``parents == [-1, 0, 1, ...]``. Siblings must carry distinct tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class DraftBudget:
    """How much the engine is willing to verify this step."""

    max_nodes: int = 8  # total draft nodes (tokens) in the chain or tree
    max_depth: int = 8  # longest root->leaf path
    width: int = 1  # max children per node in tree mode
    tree: bool = False  # False: the drafter must return a chain


@dataclass
class Draft:
    """Proposed tokens as a tree (see module docstring)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Optional draft distributions q (one probability vector per node) for drafters that have
    # them (a model drafter). None means every node is a point mass (retrieval drafters).
    probs: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "Draft":
        toks = [int(t) for t in tokens]
        return cls(toks, list(range(-1, len(toks) - 1)))

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def depth(self) -> int:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return max(d, default=0)

    def within(self, budget: DraftBudget) -> "Draft":
        """The draft cut to the budget's depth and node count (nodes in order, a cut node's
        subtree with it): drafters may overshoot near the end of a generation; cutting stays
        lossless. Topology errors are left for validate()."""
        if len(self.tokens) <= budget.max_nodes and self.depth() <= budget.max_depth:
            return self
        new: dict[int, int] = {}
        depth: dict[int, int] = {}
        keep: list[int] = []
        for i, p in enumerate(self.parents):
            if len(keep) >= budget.max_nodes or (p >= 0 and p not in new):
                continue
            d = 1 if p < 0 else depth[p] + 1
            if d > budget.max_depth:
                continue
            depth[i], new[i] = d, len(keep)
            keep.append(i)
        return Draft(
            [self.tokens[i] for i in keep],
            [-1 if self.parents[i] < 0 else new[self.parents[i]] for i in keep],
            [self.probs[i] for i in keep] if self.probs is not None else None,
        )

    def validate(self, budget: DraftBudget | None = None) -> None:
        """Raise ValueError if the tree is malformed or exceeds ``budget``."""
        if len(self.tokens) != len(self.parents):
            raise ValueError("draft tokens and parents differ in length")
        seen: set[tuple[int, int]] = set()
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if not (-1 <= p < i):
                raise ValueError(f"draft node {i} has parent {p}: parents must precede children")
            if (p, t) in seen:
                raise ValueError(f"draft node {i} repeats token {t} under parent {p}")
            seen.add((p, t))
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise ValueError("draft probs must have one vector per node")
        if budget is not None:
            if len(self.tokens) > budget.max_nodes:
                raise ValueError(f"draft has {len(self.tokens)} nodes > budget {budget.max_nodes}")
            if self.depth() > budget.max_depth:
                raise ValueError(f"draft depth {self.depth()} > budget {budget.max_depth}")
            if not budget.tree and not self.is_chain():
                raise ValueError("a chain was asked for but the draft branches")


@dataclass
class Feedback:
    """What the engine tells the drafter after one verification step."""

    committed: list[int]  # tokens appended to the context this step (accepted + bonus)
    drafted: int  # draft nodes verified this step
    accepted: int  # draft tokens accepted (len(committed) - 1 unless stopped)
    accepted_path: list[int] = field(default_factory=list)  # draft node indices accepted, root->leaf
    topk_ids: np.ndarray | None = None  # [drafted + 1, k] verifier top-k ids: row 0 = root, row i+1 = node i
    hidden: np.ndarray | None = None  # [len(committed), H] hidden states at the committed tokens' inputs
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # 0: not the drafter's to fit (a step the engine filled at a row's cost)
    rows: int = 0  # graph rows the verify forward ran (0: not known); a lone
    # token runs as 2 rows on padded decoders, 1 on rowwise ones


class Drafter:
    """Base class: a drafter that never drafts (plain decoding). Subclasses override propose."""

    name = "baseline"
    wants_topk = False  # ask the engine to compute verifier top-k ids (token_recycling)
    wants_hidden = False  # ask the engine to pass hidden states (pld_plus, adapld)

    def begin(self, prompt_ids: Sequence[int]) -> None:
        """Start a request. Per-request state is reset; global state may persist."""

    def propose(self, context: Sequence[int], budget: DraftBudget) -> Draft:
        return Draft()

    def feedback(self, fb: Feedback) -> None:
        """Learn from what the verifier accepted."""

    def end(self) -> None:
        """Finish a request (e.g. fold it into a global index)."""
