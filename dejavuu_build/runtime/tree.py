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


def row_bias(parents: list[int], past_len: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """position_ids [1, n] and an additive bias [1, 1, n, length] over a whole KV buffer (the
    rowwise flavour) for a tree fed one row per node: row i sees the past and its ancestors among
    the step's rows, nothing beyond. (Chains get theirs from layouts.rowwise.RowFeeds, without allocating.)"""
    n = len(parents)
    bias = np.full((1, 1, n, length), NEG, dtype=np.float32)
    bias[0, 0, :, :past_len] = 0
    bias[0, 0, :, past_len : past_len + n][ancestors_mask(parents)] = 0
    return (past_len + depths(parents))[None].astype(np.int64), bias


def causal_inputs(n: int, past_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A plain chain of n new tokens (prefill or chain verification)."""
    return step_inputs(list(range(-1, n - 1)), past_len)


def with_root(draft_parents: list[int]) -> list[int]:
    """Parents for [root] + draft nodes: draft roots (-1) hang off step node 0."""
    return [-1] + [p + 1 for p in draft_parents]


def aligned_layout(
    parents: list[int], period: int, max_slots: int, *, past: int = 0, tile: int | None = None
) -> tuple[list[int], list[int]]:
    """Place step nodes into slots so that every node sits at ``slot ≡ depth (mod period)`` and
    after its parent; returns (slot of each kept node or -1 if pruned, parents per slot with -1
    for pad slots and roots).

    Why: ORT's attention sums keys in SIMD blocks of ``period`` keys. A node whose ancestors lie
    at the same offsets modulo ``period`` as in a plain chain gets bit-identical logits (masked
    keys contribute exact zeros), which keeps tree verification exactly equal to plain decoding
    even when int8 activations would amplify a last-bit difference. Column 0 holds the root and
    its first-child path (no padding for chains); each further branch starts a new column, and
    nodes that would need a slot beyond ``max_slots`` are pruned with their subtrees.

    The kernel also groups keys in tiles (measured per machine, docs/exactness.md): a node whose slot
    falls in another ``tile`` than its chain position ``past + depth`` is pruned too, so near a
    tile boundary a tree briefly narrows to its first-child path instead of losing exactness.
    """
    n = len(parents)
    d = depths(parents)
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    slot = [-1] * n
    used: set[int] = set()
    stack = [0]
    while stack:  # preorder DFS, first child first
        u = stack.pop()
        p = parents[u]
        lo = 0 if p < 0 else slot[p] + 1
        s = int(d[u])
        while s < lo or s in used:
            s += period
        crosses = tile is not None and (past + s) // tile != (past + int(d[u])) // tile
        if s >= max_slots or crosses or (p >= 0 and slot[p] < 0):
            continue  # pruned (its subtree too: children see slot[p] < 0)
        slot[u] = s
        used.add(s)
        stack.extend(reversed(children.get(u, [])))
    total = max(used) + 1
    slot_parents = [-1] * total
    for i in range(n):
        if slot[i] >= 0 and parents[i] >= 0:
            slot_parents[slot[i]] = slot[parents[i]]
    return slot, slot_parents


def slot_tokens(tokens: list[int], slot: list[int], n_slots: int) -> list[int]:
    """The token of every slot of an aligned layout: kept nodes at their slots, pads repeat the root."""
    out = [tokens[0]] * n_slots
    for i, s in enumerate(slot):
        if s >= 0:
            out[s] = tokens[i]
    return out
