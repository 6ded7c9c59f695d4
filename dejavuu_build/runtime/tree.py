"""Flatten a draft tree into what one forward pass needs, and pick the accepted path.

Node 0 of a verify step is always the root: the last committed token, whose logits predict
the first draft token. Draft node i becomes step node i+1. A node sees the committed past
and its own ancestors (and itself), never its siblings or cousins.
"""

from __future__ import annotations

import numpy as np

NEG = np.float32(np.finfo(np.float32).min)


def depths(parents: list[int]) -> np.ndarray:
    d = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        d[i] = 0 if p < 0 else d[p] + 1
    return d


def ancestors_mask(parents: list[int]) -> np.ndarray:
    """[n, n] bool: True where node i may attend node j (j is i or an ancestor of i)."""
    n = len(parents)
    vis = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            vis[i] = vis[p]
        vis[i, i] = True
    return vis


def step_inputs(parents: list[int], past_len: int) -> tuple[np.ndarray, np.ndarray]:
    """position_ids [1, n] and additive attention_bias [1, 1, n, past+n] for nodes given by parents.

    ``parents`` here covers every node of the step (the root included, with parent -1).
    """
    n = len(parents)
    pos = (past_len + depths(parents))[None, :]
    bias = np.zeros((1, 1, n, past_len + n), dtype=np.float32)
    bias[0, 0, :, past_len:][~ancestors_mask(parents)] = NEG
    return pos.astype(np.int64), bias


def causal_inputs(n: int, past_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A plain chain of n new tokens (prefill or chain verification)."""
    return step_inputs(list(range(-1, n - 1)), past_len)


def with_root(draft_parents: list[int]) -> list[int]:
    """Parents for [root] + draft nodes: draft roots (-1) hang off step node 0."""
    return [-1] + [p + 1 for p in draft_parents]
