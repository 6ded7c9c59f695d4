"""The gates' calling form over the runtime's Decoder: explicit positions, additive mask and past
arrays in, present out -- the layout's driver adapts the past to its graph
(layouts.base.Driver.forward_past; a rowwise graph's tiles: layouts.rowwise.RowwiseDriver.past_feeds)."""

from __future__ import annotations

import numpy as np

from ..runtime.decoder import Decoder
from ..runtime.tree import causal_inputs
from ..schema import Contract


class Runner:
    """Torch-free forwards over an ORT decoder session, as the gates feed them (``dec``: the
    runtime's Decoder on the same session, for the gates that run it as the runtime does)."""

    def __init__(self, session, contract: Contract, embed=None):
        self.s = session
        self.c = contract
        self.embed = embed  # callable ids -> embeds, for inputs_embeds decoders
        self.dec = Decoder(session, contract, embed)

    def forward(self, ids: np.ndarray, pos: np.ndarray, bias: np.ndarray, past: dict):
        """``bias`` is past+new wide; returns (logits, hidden states, present as the next past)."""
        return self.dec.driver.forward_past(ids, pos, bias, past)

    def prefill(self, ids: np.ndarray):
        pos, bias = causal_inputs(len(ids), 0)
        return self.forward(ids, pos, bias, self.dec.driver.empty_past())
