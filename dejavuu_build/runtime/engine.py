"""The speculative decoding loop: prefill, then per step draft -> one forward -> accept -> keep KV.

Engine.generate drives one request's Job (runtime.job) with one Decoder (runtime.decoder) and its
KV cache; the server's scheduler drives Jobs the same way over a batched graph.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Sequence

import numpy as np

from ..errors import GenerationError
from .decoder import Decoder
from .drafters.base import DraftBudget, Drafter
from .job import STEP_ROOM, GenerationStats, Job, ResidualFn, StopFn, Successors
from .sampling import Sampler, residual


class Engine:
    def __init__(
        self,
        decoder: Decoder,
        *,
        tree_capable: bool,
        period: int | None = None,
        tile: int | None = None,
        fill: Successors | None = None,
    ):
        """``period`` and ``tile`` come from runtime.calibration: the layout that keeps tree rows
        bit-identical to chains on this machine. ``fill``: where an empty draft takes its one
        guess from (see Successors); None keeps empty steps plain (the exactness reference)."""
        self.dec = decoder
        self.tree_capable = tree_capable and period is not None
        self.period = period
        self.tile = tile
        self.fill = fill

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        drafter: Drafter,
        sampler: Sampler,
        max_new_tokens: int,
        tree: bool = False,
        budget: DraftBudget | None = None,
        eos_ids: Sequence[int] = (),
        should_stop: StopFn | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        prefill_embeds: np.ndarray | None = None,
        residual_fn: ResidualFn = residual,
        validate_drafts: bool = False,
    ) -> tuple[list[int], GenerationStats, str]:
        """Generate up to ``max_new_tokens``; returns (new token ids, stats, stop reason).
        Drafts are validated on every step; ``validate_drafts`` is kept for callers that pass it."""
        budget = budget or DraftBudget()
        if budget.tree and not (tree and self.tree_capable):
            budget = DraftBudget(budget.max_nodes, budget.max_depth, 1, False)
        tokens = [int(t) for t in prompt_ids]
        cap = self.dec.capacity
        if cap and len(tokens) + max_new_tokens + STEP_ROOM > cap:
            raise GenerationError(
                f"prompt ({len(tokens)} tokens) + max_new_tokens ({max_new_tokens}) does not fit "
                f"this decoder's KV cache of {cap} positions: shorten the prompt, lower "
                f"max_new_tokens or rebuild with a larger --max-context"
            )
        job = Job(
            tokens,
            drafter=drafter,
            sampler=sampler,
            max_new_tokens=max_new_tokens,
            budget=budget,
            period=self.period if budget.tree else None,
            tile=self.tile if budget.tree else None,
            eos_ids=eos_ids,
            should_stop=should_stop,
            on_tokens=on_tokens,
            prefill_embeds=prefill_embeds,
            capacity=cap,
            fill=self.fill,
            residual_fn=residual_fn,
            single_rows=self.dec.single_rows,
        )
        kv = self.dec.new_cache()
        try:
            while job.prefilling:  # chunks bound the logits buffer of a long prompt
                rows = job.prefill_rows()
                logits, hidden, present = self.dec.prefill(rows.tokens, kv, job.prompt_len, job.room, rows.embeds)
                job.after_prefill(partial(kv.commit, present), logits, hidden)
            while not job.done:
                rows = job.plan(kv.length)
                t0 = time.perf_counter()
                logits, hidden, present = self.dec.forward(rows.tokens, rows.parents, kv, copy=False, slots=rows.slots)
                job.after_step(
                    partial(kv.commit, present), logits, hidden, time.perf_counter() - t0, self.dec.last_run_s
                )
        finally:
            kv.release()
        assert job.reason is not None  # the loop ends when the job has its reason to stop
        return job.new, job.stats, job.reason
