"""Draft construction shared by all drafters: best-first growth of a chain or tree.

Every drafter reduces to "a root state and a way to list its children with conditional
probabilities"; :func:`best_first` turns that into a :class:`Draft` that always satisfies
``draft.validate(budget)``. Chain mode is the same search with width 1.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Callable, Hashable, Iterable, Iterator, Sequence, TypeVar

from .base import Draft, DraftBudget

State = TypeVar("State", bound=Hashable)
# a state -> its children as (token, conditional probability, child state)
Children = Callable[[State], Iterable[tuple[int, float, State]]]


def best_first(
    root: State,
    children: Children[State],
    budget: DraftBudget,
    *,
    max_nodes: int | None = None,
    max_depth: int | None = None,
    min_score: float = 0.0,
    depth_decay: float = 1.0,
) -> Draft:
    """Grow a draft by repeatedly adding the frontier node with the highest path score.

    ``children(state)`` yields ``(token, p, child_state)``; a node's score is its parent's
    score times ``p`` (times ``depth_decay`` below the first level, a prior that long copies
    get less likely to be accepted). Scores never grow with depth, so parents are always added
    before their children (topological order). Each node keeps at most ``budget.width``
    children (1 in chain mode), and repeated sibling tokens are skipped.
    """
    width = budget.width if budget.tree else 1
    nodes_cap = budget.max_nodes if max_nodes is None else min(max_nodes, budget.max_nodes)
    depth_cap = budget.max_depth if max_depth is None else min(max_depth, budget.max_depth)
    tokens: list[int] = []
    parents: list[int] = []
    if nodes_cap <= 0 or depth_cap <= 0 or width <= 0:
        return Draft()
    n_kids: dict[int, int] = {}
    heap: list = []
    tick = count()

    def expand(state, parent: int, depth: int, score: float) -> None:
        if depth >= depth_cap:
            return
        factor = score * (depth_decay if depth else 1.0)
        seen: set[int] = set()
        for tok, p, child in children(state):
            tok = int(tok)
            if p <= 0 or tok < 0 or tok in seen:
                continue
            seen.add(tok)
            heapq.heappush(heap, (-factor * p, next(tick), tok, parent, depth + 1, child))

    expand(root, -1, 0, 1.0)
    while heap and len(tokens) < nodes_cap:
        neg, _, tok, parent, depth, child = heapq.heappop(heap)
        if -neg < min_score:
            break
        if n_kids.get(parent, 0) >= width:
            continue
        n_kids[parent] = n_kids.get(parent, 0) + 1
        tokens.append(tok)
        parents.append(parent)
        expand(child, len(tokens) - 1, depth, -neg)
    return Draft(tokens, parents)


def continuation_tree(
    seqs: Sequence[Sequence[int]],
    weights: Sequence[float],
    budget: DraftBudget,
    **kwargs,
) -> Draft:
    """Merge weighted candidate continuations into a trie and grow a draft from it.

    A trie node's score is the share of total weight whose continuation passes through it,
    so frequent continuations win and, with geometric recency weights, the latest one does.
    Ties go to the earlier sequence in ``seqs``.
    """
    kids: list[dict[int, int]] = [{}]
    weight = [0.0]
    for seq, w in zip(seqs, weights):
        if not seq or w <= 0:
            continue
        node = 0
        weight[0] += w
        for tok in seq:
            nxt = kids[node].get(tok)
            if nxt is None:
                nxt = kids[node][tok] = len(weight)
                kids.append({})
                weight.append(0.0)
            weight[nxt] += w
            node = nxt
    if weight[0] <= 0:
        return Draft()

    def children(node: int) -> Iterator[tuple[int, float, int]]:
        total = weight[node]
        return ((tok, weight[c] / total, c) for tok, c in kids[node].items())

    return best_first(0, children, budget, **kwargs)


def accepted_length(draft: Draft, truth: Sequence[int]) -> int:
    """How many draft tokens a greedy verifier that produces ``truth`` would accept."""
    kids: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(draft.tokens, draft.parents))}
    node, n = -1, 0
    for tok in truth:
        nxt = kids.get((node, int(tok)))
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n
