"""Parity of a decoder graph with the concat graph it is made from (tests of the KV layouts and of
the passes after them): prefill, then a tree over the prompt, through the build's Runner; and of a
drafter's tokens with plain decoding's on one model."""

from __future__ import annotations

import numpy as np

from dejavuu_build.build.runner import Runner
from dejavuu_build.runtime.session import derive_contract, make_session
from dejavuu_build.runtime.tree import step_inputs


def runner(path):
    sess = make_session(path, threads=1)
    return Runner(sess, derive_contract(sess))


def matches_concat(concat, other, atol=2e-5):
    """Prefill 21 tokens, then a 7-node tree over them: logits, hidden states and the K/V of the
    prompt from ``other`` match the concat graph's. Returns ``other``'s past after the prefill."""
    rng = np.random.default_rng(1)
    past_ids = rng.integers(3, 200, 21)
    lc, hc, pc = concat.prefill(past_ids)
    lo, ho, po = other.prefill(past_ids)
    np.testing.assert_allclose(lo, lc, atol=atol)
    np.testing.assert_allclose(ho, hc, atol=atol)
    for k in pc:
        np.testing.assert_allclose(po[k][:, :, :21], pc[k], atol=atol)
    parents = [-1, 0, 0, 1, 2, 3, 1]
    toks = rng.integers(3, 200, len(parents))
    pos, bias = step_inputs(parents, 21)
    tc, thc, _ = concat.forward(toks, pos, bias, pc)
    to, tho, _ = other.forward(toks, pos, bias, po)
    np.testing.assert_allclose(to, tc, atol=atol)
    np.testing.assert_allclose(tho, thc, atol=atol)
    return po


def assert_lossless(model, method: str, prompts, max_new_tokens: int = 30, seed: int = 5) -> None:
    """``method`` in chains and in trees, greedy and sampled, gives plain decoding's tokens on
    every prompt (drafts validated)."""
    for prompt in prompts:
        for temp in (0.0, 0.9):
            base = model.generate(prompt, max_new_tokens=max_new_tokens, temperature=temp, seed=seed)
            for tree in (False, True):
                r = model.generate(
                    prompt,
                    method=method,
                    tree=tree,
                    max_new_tokens=max_new_tokens,
                    temperature=temp,
                    seed=seed,
                    validate_drafts=True,
                )
                assert r.tokens == base.tokens, (method, tree, temp, prompt)
