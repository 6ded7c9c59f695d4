"""The decoder graph's I/O: one onnxruntime session driven through its contract and its KV layout.

Why apart from the loop: the gates, the calibration, the model drafter and the server's exactness
check run the same forwards without a generation around them. ``Decoder.forward`` feeds tokens
(a chain, a tree's rows or its aligned slots) over a KV cache from ``new_cache`` and returns
logits, hidden states and the concat layout's present. What depends on the layout -- the cache,
the feeds, how a step runs -- is the layout's driver (``layouts.LAYOUTS[kv_layout].driver``, in
layouts/<layout>.py); the Decoder holds the session, the contract and how a lone token is run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..errors import GenerationError
from ..layouts import LAYOUTS, Cache
from ..schema import MASK_ADDITIVE_4D, Contract


class Decoder:
    """One ORT decoder session driven through its (derived) contract and its layout's driver."""

    def __init__(
        self,
        session: Any,
        contract: Contract,
        embed: Callable[[np.ndarray], np.ndarray] | None = None,
        prefill: Any = None,
    ):
        """``prefill``: the session of the variant's prefill graph (export.passes.rowwise_prefill),
        which runs prompt chunks over the same KV buffer (rowwise variants only); None: prompts run
        on ``session`` too."""
        self.s = session
        self.c = contract
        self.embed = embed
        self.prefill_s = prefill
        self.out_names = [o.name for o in session.get_outputs()]
        self.kv_in = [
            contract.kv_input_pattern.format(i=i, kv=kv) for i in range(contract.num_layers) for kv in ("key", "value")
        ]
        self.kv_out = [
            contract.kv_output_pattern.format(i=i, kv=kv) for i in range(contract.num_layers) for kv in ("key", "value")
        ]
        self.has_hidden = contract.hidden_output is not None
        if contract.mask_kind == MASK_ADDITIVE_4D and contract.mask_input is None:
            raise GenerationError(
                "the contract's mask is additive_4d but names no mask input: re-derive it from the graph"
            )
        if contract.kv_layout not in LAYOUTS:
            raise GenerationError(f"no KV layout {contract.kv_layout!r} is registered (known: {', '.join(LAYOUTS)})")
        self.layout = LAYOUTS[contract.kv_layout]
        if prefill is not None and self.layout.prefill_pass is None:
            raise GenerationError(f"the {contract.kv_layout} KV layout has no prefill graph")
        # rowwise graphs run every row on one-row kernels, and a length-invariant graph (row guard,
        # export.passes.row_guard) pads inside itself where an op needs it: a lone token is one row
        self.rowwise = self.layout.driver.one_row
        self.pad_single = not (
            self.rowwise or contract.length_invariant
        )  # see PaddedDriver; changed only through padding()
        self.static = self.layout.in_place  # buffers bound as past and present
        self.capacity = contract.kv_capacity if self.static else 0
        self.driver = self.layout.driver(self)

    @property
    def sparse(self) -> bool:
        """Rows decoupled from attention slots (export.passes.static_kv): pad slots cost attention only."""
        return self.driver.sparse

    @property
    def last_run_s(self) -> float:
        """Seconds inside onnxruntime's run in the last forward."""
        return self.driver.last_run_s

    def reclaim(self, buffers: np.ndarray, binding: Any) -> None:
        """Take back a released cache's buffers and their IOBinding (StaticKV.release): the next
        new_cache reuses them instead of mapping a capacity's worth of fresh memory."""
        self.driver.reclaim(buffers, binding)

    @property
    def pooled(self) -> list[np.ndarray]:
        """The released buffers waiting for reuse (in release order)."""
        return [b for b, _ in self.driver.free]

    @contextmanager
    def padding(self, pad: bool) -> Iterator[Decoder]:
        """``pad_single`` is ``pad`` inside the block and the decoder's own setting again after:
        the gates time the raw one-row path with it and the bench its one-row reference; the
        runtime never changes it (Engine and Model.plan read it to know what a lone token costs)."""
        old, self.pad_single = self.pad_single, pad
        try:
            yield self
        finally:
            self.pad_single = old

    @property
    def single_rows(self) -> int:
        """Graph rows a lone token's step runs (its pad row, if any)."""
        return 2 if self.pad_single else 1

    def new_cache(self) -> Cache:
        return self.driver.new_cache()

    def forward(
        self,
        tokens: Sequence[int],
        parents: list[int] | None,
        kv: Cache,
        embeds: np.ndarray | None = None,
        copy: bool = True,
        slots: Sequence[int] | None = None,
        last: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None, list[np.ndarray] | None]:
        """Run new ``tokens`` (a chain when ``parents`` is None) over the cached past.

        ``slots``: a tree in an aligned slot layout (Job.plan): ``parents`` then covers the slots
        (pads: -1) and ``slots[i]`` is token i's slot; outputs come back per token. A graph with
        rows decoupled from slots (export.passes.static_kv) runs the tokens only; others run every
        slot; a rowwise graph takes chains, or trees one row per node, and no slot layout.

        A single token is padded to two graph rows where ``pad_single`` (layouts.base.PaddedDriver
        says why). With ``copy=False`` an in-place layout's returned rows are views, valid until
        the next forward (the engine's hot path reads them before that). ``last``: logits of the
        last ``last`` tokens only (a prefill keeps its last row's; a graph without the lm-head
        slice, export.exporter.slice_logits, returns all); hidden states come for every token.
        """
        return self.driver.forward(tokens, parents, kv, embeds, copy, slots, last)

    def prefill(
        self, tokens: Sequence[int], kv: Cache, prompt: int, room: int, embeds: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None, list[np.ndarray] | None]:
        """One chunk of a ``prompt``-token prompt over ``kv``: as ``forward`` of a chain with
        ``copy=False, last=1`` (the last row's logits, views valid until the next forward; ``kv``
        not committed; ``embeds`` [n, H] for an inputs_embeds decoder). The
        engine and the server prefill through here alike (schema.PREFILL_CHUNK chunks), so a
        prompt's K/V have the same bits whichever runs it: a rowwise decoder runs its chunks on
        the prefill graph where it has one, and sizes its buffer before the last chunk for
        ``room`` more positions (layouts.rowwise.GrowingKV.reserve)."""
        return self.driver.prefill(tokens, kv, prompt, room, embeds)

    def embeddings(self, ids: np.ndarray) -> np.ndarray:
        """ids [1, N] -> inputs_embeds [1, N, H] through the embedder the decoder was opened with."""
        if self.embed is None:
            raise GenerationError("this decoder takes inputs_embeds and was opened without an embedder: pass embeds")
        return self.embed(ids)
