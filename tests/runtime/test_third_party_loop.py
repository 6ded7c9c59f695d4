"""Exact in any runtime: a decode loop that knows nothing of dejavuu-build (onnxruntime + numpy,
one forward per step, drafts verified as rows, the KV cache as the graph returns it) gets
speculative output equal to its own plain decoding, and every verified row's logits bit-identical
to that row decoded alone. That holds because the graph is length-invariant by construction
(export.passes.row_guard), not because of our runtime's padding."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from dejavuu_build import schema as S

NEG = np.float32(np.finfo(np.float32).min)


class PlainLoop:
    """A third party's loop over a concat-layout decoder: ``past_key_values.*`` in, ``present.*`` out."""

    def __init__(self, path, contract: dict):
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        self.s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.layers, self.kv_heads, self.dim = contract["num_layers"], contract["num_kv_heads"], contract["head_dim"]
        self.names = [o.name for o in self.s.get_outputs()]

    def empty(self):
        z = np.zeros((1, self.kv_heads, 0, self.dim), np.float32)
        return {f"past_key_values.{i}.{kv}": z for i in range(self.layers) for kv in ("key", "value")}

    def forward(self, tokens, past: dict):
        n, p = len(tokens), next(iter(past.values())).shape[2]
        bias = np.zeros((1, 1, n, p + n), np.float32)
        bias[0, 0, :, p:][np.triu(np.ones((n, n), bool), 1)] = NEG  # causal among the new rows
        feeds = {
            "input_ids": np.asarray([tokens], np.int64),
            "position_ids": np.arange(p, p + n)[None],
            "attention_bias": bias,
            **past,
        }
        out = dict(zip(self.names, self.s.run(None, feeds)))
        present = {
            f"past_key_values.{i}.{kv}": out[f"present.{i}.{kv}"] for i in range(self.layers) for kv in ("key", "value")
        }
        return out["logits"][0], present

    def plain(self, prompt, n):
        logits, past = self.forward(prompt, self.empty())
        out, rows = [int(logits[-1].argmax())], []
        while len(out) < n:
            lg, past = self.forward([out[-1]], past)
            rows.append(lg[0])
            out.append(int(lg[0].argmax()))
        return out, rows

    def speculative(self, prompt, n, drafts):
        """Greedy verification of ``drafts(context) -> tokens`` as rows after the pending token."""
        logits, past = self.forward(prompt, self.empty())
        out, rows, verified = [int(logits[-1].argmax())], [], 0
        while len(out) < n:
            d = list(drafts(list(prompt) + out))[: n - len(out)]
            lg, present = self.forward([out[-1]] + d, past)
            keep = 1
            while keep <= len(d) and d[keep - 1] == int(lg[keep - 1].argmax()):
                keep += 1
            verified += len(d)
            past = {k: v[:, :, : v.shape[2] - (len(d) + 1) + keep] for k, v in present.items()}
            for j in range(keep):
                rows.append(lg[j])
                out.append(int(lg[j].argmax()))
        return out[:n], rows[: n - 1], verified


def _lookup(ctx, k=4):
    """Prompt lookup: the tokens after the last earlier occurrence of the context's last bigram."""
    for i in range(len(ctx) - 3, -1, -1):
        if ctx[i : i + 2] == ctx[-2:]:
            return ctx[i + 2 : i + 2 + k]
    return []


@pytest.mark.parametrize("variant", ["fp32", "int8", "int4"])
def test_plain_loop_speculative_equals_plain(tiny_llama, variant):
    m = S.read_manifest(tiny_llama)
    rec = m.variants[variant]
    assert rec.length_invariant, rec.row_guard  # the build made the concat graph length-invariant
    loop = PlainLoop(tiny_llama / rec.file, S.read_contract(tiny_llama).to_json())
    prompt = [5, 17, 23, 9, 17, 23, 41, 5, 17]
    ref, ref_rows = loop.plain(prompt, 40)
    truth = list(prompt) + ref

    # drafts: prompt lookup, and a drafter that proposes the true continuation with every third
    # token wrong (long verifies, accepted and rejected rows)
    def oracle(ctx):
        return [t if (len(ctx) + j) % 3 else (t + 1) % 50 for j, t in enumerate(truth[len(ctx) : len(ctx) + 6])]

    for drafts in (_lookup, oracle):
        got, rows, verified = loop.speculative(prompt, 40, drafts)
        assert got == ref
        assert all(np.array_equal(a, b) for a, b in zip(rows, ref_rows)), "a verified row's logits differ from it alone"
        if drafts is oracle:
            assert verified >= 30
