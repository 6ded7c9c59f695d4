"""The torch references' quality set: fp32's greedy continuations of the quality texts, batched."""

from __future__ import annotations

import numpy as np


def test_the_quality_set_reads_only_the_last_logits_and_keeps_its_tokens(tmp_path):
    """The batched greedy continuations ask the model for the last position's logits only
    (logits_to_keep=1: the prefill's lm-head over every prompt row is skipped) and give the same
    tokens as the same loop computing every row's logits."""
    import torch
    from tiny import save_tiny
    from transformers import AutoModelForCausalLM

    from dejavuu_build.build import references as R

    src = save_tiny("llama", tmp_path / "src")
    lm = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32).eval()
    seen: list[int] = []
    forward = lm.forward

    def spy(*a, logits_to_keep=0, **k):
        seen.append(logits_to_keep)
        return forward(*a, logits_to_keep=logits_to_keep, **k)

    lm.forward = spy  # type: ignore[method-assign]
    with torch.no_grad():
        lean = R._torch_quality_set(lm, None, lm.config.vocab_size, "input_ids")
    assert seen and set(seen) == {1}

    def every_row(*a, logits_to_keep=0, **k):
        return forward(*a, **k)

    lm.forward = every_row  # type: ignore[method-assign]
    full = R._torch_quality_set(lm, None, lm.config.vocab_size, "input_ids")
    assert len(lean.continuations) == len(full.continuations) > 1
    for a, b in zip(lean.continuations, full.continuations):
        np.testing.assert_array_equal(a, b)
