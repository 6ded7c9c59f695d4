"""A minimal torch-free forward helper over an ORT decoder session, as the gates feed it: explicit
positions and additive mask, the past as arrays (a rowwise graph gets them padded to whole tiles)."""

from __future__ import annotations

import numpy as np

from ..runtime.session import empty_past
from ..runtime.tree import causal_inputs
from ..schema import INPUT_IDS, INPUTS_EMBEDS, KV_ROWWISE, KV_WRITE_INDEX, ROW_SLOTS, SLOT_ROWS, Contract


class Runner:
    """Minimal torch-free forward helper over an ORT decoder session."""

    def __init__(self, session, contract: Contract, embed=None):
        self.s = session
        self.c = contract
        self.embed = embed  # callable ids -> embeds, for inputs_embeds decoders
        self.out_names = [o.name for o in session.get_outputs()]
        self.sparse = SLOT_ROWS in {i.name for i in session.get_inputs()}  # static flavour: rows = slots here

    def forward(self, ids: np.ndarray, pos: np.ndarray, bias: np.ndarray, past: dict):
        """``bias`` is past+new wide. A rowwise graph gets the past arrays and the bias padded to a
        whole number of buffer tiles (what the runtime binds) and its present is cut back."""
        total = bias.shape[-1]
        feeds = dict(past)
        if self.c.kv_layout == KV_ROWWISE:
            from ..runtime.decoder import ROWWISE_TILE
            from ..runtime.kv import round_up
            from ..runtime.tree import NEG

            pad = round_up(total, ROWWISE_TILE) - total
            feeds = {k: np.pad(v, ((0, 0), (0, 0), (0, pad + total - v.shape[2]), (0, 0))) for k, v in past.items()}
            bias = np.pad(bias, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=NEG)
            feeds[KV_WRITE_INDEX] = np.array([total - len(ids)], np.int64)
        if self.c.primary_input == INPUTS_EMBEDS:
            feeds[INPUTS_EMBEDS] = self.embed(ids[None])
        else:
            feeds[INPUT_IDS] = ids[None].astype(np.int64)
        feeds["position_ids"] = pos
        feeds["attention_bias"] = bias
        if self.sparse:
            feeds[SLOT_ROWS] = feeds[ROW_SLOTS] = np.arange(len(ids), dtype=np.int64)
        out = dict(zip(self.out_names, self.s.run(None, feeds)))
        keep = total if self.c.kv_layout == KV_ROWWISE else None
        pattern_in, pattern_out = self.c.kv_input_pattern, self.c.kv_output_pattern
        present = {
            pattern_in.format(i=i, kv=kv): out[pattern_out.format(i=i, kv=kv)][:, :, :keep]
            for i in range(self.c.num_layers)
            for kv in ("key", "value")
        }
        return out["logits"][0], out.get("hidden_states", np.zeros((1, 0)))[0], present

    def prefill(self, ids: np.ndarray):
        pos, bias = causal_inputs(len(ids), 0)
        return self.forward(ids, pos, bias, empty_past(self.c))
