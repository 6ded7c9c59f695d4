"""Speculative sampling follows the target distribution (chi-squared on a small-vocabulary
model) and fails the test when the residual is deliberately wrong."""

from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from dejavuu_build.runtime import load
from dejavuu_build.runtime.model_drafter import ModelDrafter
from dejavuu_build.runtime.sampling import Sampler, residual


def _export_small(folder: Path, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dejavuu_build.export.exporter import export_decoder
    from dejavuu_build.recipes import registered

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(6)  # a spread, non-uniform target
    folder.mkdir(parents=True, exist_ok=True)
    export_decoder(m, registered()["llama"](), folder / "decoder.onnx")
    return folder / "decoder.onnx"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return load(_export_small(d / "target", 1)), load(_export_small(d / "draft", 2))


PROMPT = [1, 2, 3]
T = 1.0


def _exact_second_token(target) -> tuple[np.ndarray, np.ndarray]:
    """Exact marginals of the 1st and 2nd generated tokens under the target."""
    s = Sampler(temperature=T)

    dec = target.decoder
    kv = dec.new_cache()
    lg, _, pres = dec.forward(PROMPT, None, kv)
    p1 = s.probs(lg[-1])
    kv.commit(pres, len(PROMPT), list(range(len(PROMPT))))
    p2 = np.zeros_like(p1)
    for t in range(len(p1)):
        lg2, _, _ = dec.forward([t], None, kv)
        p2 += p1[t] * s.probs(lg2[0])
    return p1, p2


def _sample(target, draft, n, residual_fn=None):
    firsts, seconds = [], []
    for seed in range(100_000, 100_000 + n):
        d = ModelDrafter(draft, temperature=0.3, seed=seed)  # q peaked and unlike p
        r = target.generate(
            PROMPT,
            method=d,
            max_new_tokens=3,
            temperature=T,
            seed=seed,
            **({"residual_fn": residual_fn} if residual_fn else {}),
        )
        assert r.stats.drafted >= 1  # the 2nd token went through accept/reject
        firsts.append(r.tokens[0])
        seconds.append(r.tokens[1])
    return np.array(firsts), np.array(seconds)


def _pvalue(samples, p):
    counts = np.bincount(samples, minlength=len(p))
    keep = p * len(samples) >= 5
    exp = p[keep] * len(samples)
    obs = counts[keep]
    exp = exp * obs.sum() / exp.sum()
    return sps.chisquare(obs, exp).pvalue


def test_model_drafter_sampling_matches_target(small):
    target, draft = small
    p1, p2 = _exact_second_token(target)
    f, s = _sample(target, draft, 2000)
    assert _pvalue(f, p1) > 1e-3 and _pvalue(s, p2) > 1e-3


def test_wrong_residual_is_caught(small):
    target, draft = small
    p1, p2 = _exact_second_token(target)
    f, s = _sample(target, draft, 2000, residual_fn=lambda p, q: p)  # resample from p: biased
    assert min(_pvalue(f, p1), _pvalue(s, p2)) < 1e-4


def test_model_drafter_greedy_is_lossless_and_accepts(small):
    target, draft = small
    base = target.generate(PROMPT, max_new_tokens=12)
    r = target.generate(PROMPT, method=ModelDrafter(target), max_new_tokens=12)  # self-drafting
    assert r.tokens == base.tokens and r.stats.accepted > 0
    r = target.generate(PROMPT, method=ModelDrafter(draft), max_new_tokens=12, tree=True)
    assert r.tokens == base.tokens


def test_residual_and_probs():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.1, 0.6, 0.3])
    assert np.allclose(residual(p, q), [1.0, 0.0, 0.0])
    s = Sampler(temperature=1.0, top_k=2)
    pr = s.probs(np.log(p))
    assert pr[2] == 0 and np.isclose(pr.sum(), 1)
    s = Sampler(temperature=1.0, top_p=0.6)
    assert (s.probs(np.log(p)) > 0).sum() == 2
    assert Sampler().pick(np.array([0.1, 3.0, 0.2]), 0) == 1
