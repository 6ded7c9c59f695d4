"""Torch fp32 references, computed once at export time with transformers' own masks (eager
attention) and saved as ``reference.npz``, so every ORT-side gate -- and quant-only -- runs
without torch: greedy continuations of real prompts, a chain and a real tree with their logits
and hidden states, and the quality set's continuations."""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..log import logger
from .quality import QUALITY_PROMPT_TOKENS, QUALITY_TOKENS, QualitySet

TREE_PARENTS = [-1, -1, 0, 0, 2, 1, 4]  # siblings at two levels, a deep branch, a cousin
PROMPTS = [
    "Translate to French: The weather is lovely today and we are going to the beach.",
    "Summarize: Speculative decoding drafts several tokens cheaply and verifies them in one forward pass of the large model, keeping the output identical.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: A train travels 120 km in 1.5 hours. What is its average speed? Answer step by step.",
]
LONG_TEXT = (
    "The history of computing is a story of layers: hardware, operating systems, compilers and "
    "languages, each hiding the complexity beneath it so that people can build the next layer. "
)


@dataclass
class Reference:
    prompts: list[np.ndarray]
    greedy: list[np.ndarray]
    chain_ids: np.ndarray  # the chain parity sequence
    chain_split: int  # prefill length; the rest is one chunk over that past
    chain_logits: np.ndarray  # torch logits at every position of chain_ids [T, V]
    chain_hidden: np.ndarray  # torch hidden states [T, H]
    tree_tokens: np.ndarray  # tree node tokens (node 0 = root = last past token's successor)
    tree_parents: np.ndarray
    tree_logits: np.ndarray  # torch logits of each node's root->node path run as a chain
    tree_hidden: np.ndarray
    quality: "QualitySet | None" = None  # the quality texts and torch's greedy continuations

    def save(self, path: Path) -> None:
        q: dict[str, Any] = {}
        if self.quality is not None:
            q = {
                "quality_prompts": np.concatenate(self.quality.prompts),
                "quality_prompt_lens": [len(p) for p in self.quality.prompts],
                "quality_continuations": np.stack(self.quality.continuations),
                "quality_source": np.array(self.quality.source),
            }
        np.savez_compressed(
            path,
            **q,
            prompt_concat=np.concatenate(self.prompts),
            prompt_lens=[len(p) for p in self.prompts],
            greedy=np.stack(self.greedy),
            chain_ids=self.chain_ids,
            chain_split=self.chain_split,
            chain_logits=self.chain_logits.astype(np.float32),
            chain_hidden=self.chain_hidden.astype(np.float32),
            tree_tokens=self.tree_tokens,
            tree_parents=self.tree_parents,
            tree_logits=self.tree_logits.astype(np.float32),
            tree_hidden=self.tree_hidden.astype(np.float32),
        )

    @classmethod
    def load(cls, path: Path) -> "Reference":
        z = np.load(path)
        offs = np.cumsum(np.r_[0, z["prompt_lens"]])
        prompts = [z["prompt_concat"][offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]
        quality = None
        if "quality_prompts" in z:  # builds before the quality gate have none: it is made then
            qo = np.cumsum(np.r_[0, z["quality_prompt_lens"]])
            quality = QualitySet(
                [z["quality_prompts"][qo[i] : qo[i + 1]] for i in range(len(qo) - 1)],
                list(z["quality_continuations"]),
                str(z["quality_source"]),
            )
        return cls(
            prompts,
            list(z["greedy"]),
            z["chain_ids"],
            int(z["chain_split"]),
            z["chain_logits"],
            z["chain_hidden"],
            z["tree_tokens"],
            z["tree_parents"],
            z["tree_logits"],
            z["tree_hidden"],
            quality,
        )


def compute_reference(
    model,
    recipe,
    tokenizer,
    *,
    hidden_layer: int = -1,
    new_tokens: int = 24,
    min_chain: int = 48,
    seed: int = 0,
    primary: str = "input_ids",
) -> Reference:
    """Torch fp32 references, with transformers' own masks (eager attention), never our wrapper."""
    with torch_threads():
        return _compute_reference(
            model,
            recipe,
            tokenizer,
            hidden_layer=hidden_layer,
            new_tokens=new_tokens,
            min_chain=min_chain,
            seed=seed,
            primary=primary,
        )


@contextmanager
def torch_threads():
    """torch's intra-op threads for the references: one per core left free by the machine's other
    load (the 1-minute load average, less this build's own thread), at least one. Oversubscribed,
    OpenMP threads wait on each other at every op: on 2 shared cores under load, SmolLM2's references
    took 949 s with 2 threads and ~100 s with one (the same tokens either way: measured 2026-12-02)."""
    import torch

    before = torch.get_num_threads()
    try:
        others = max(0.0, os.getloadavg()[0] - 1.0)
    except OSError:
        others = 0.0
    want = max(1, min(before, int((os.cpu_count() or 1) - round(others))))
    if want != before:
        logger.info("  %d torch thread%s (load average: the machine is shared)", want, "" if want == 1 else "s")
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _compute_reference(
    model, recipe, tokenizer, *, hidden_layer: int, new_tokens: int, min_chain: int, seed: int, primary: str
) -> Reference:
    import torch

    lm = recipe.text_causal_lm(model).eval()
    cfg = lm.config
    prev = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        # Cross every window the config itself declares (not the recipe's hook, which could miss
        # one), and the original RoPE length of a RoPE that switches there by sequence length.
        from ..recipes.base import STATIC_ROPE_TYPES, config_windows, original_rope_length, rope_type

        limit = int(getattr(recipe.text_config(model.config), "max_position_embeddings", 0) or 0)
        # a window as long as the context never narrows anything (Phi-3.5: 262144 over 4096 positions)
        spans = [w for w in config_windows(model.config) if w and (not limit or w < limit)]
        orig = original_rope_length(model.config)
        if orig and rope_type(model.config) not in STATIC_ROPE_TYPES and (not limit or orig + 24 <= limit):
            spans.append(orig)
        min_chain = max(min_chain, (max(spans) + 24) if spans else 0)

        def run(ids: np.ndarray):
            t = torch.tensor(ids, dtype=torch.long)[None]
            with torch.no_grad():
                if primary == "inputs_embeds":
                    out = lm(inputs_embeds=lm.get_input_embeddings()(t), output_hidden_states=True, use_cache=False)
                else:
                    out = lm(input_ids=t, output_hidden_states=True, use_cache=False)
            return out.logits[0].float().numpy(), out.hidden_states[hidden_layer][0].float().numpy()

        prompts = []
        for text in PROMPTS:
            ids = (
                tokenizer(text, add_special_tokens=False)["input_ids"]
                if tokenizer is not None
                else list(np.random.default_rng(len(text)).integers(3, cfg.vocab_size, 12))
            )
            prompts.append(np.array(ids[:96] or [1], dtype=np.int64))
        greedy = [_torch_greedy(lm, p, new_tokens, primary) for p in prompts]
        chain = np.concatenate([prompts[0], greedy[0]])
        if len(chain) < min_chain:
            filler = (
                tokenizer(LONG_TEXT * (1 + min_chain // 20), add_special_tokens=False)["input_ids"]
                if tokenizer is not None
                else list(np.random.default_rng(1).integers(3, cfg.vocab_size, min_chain))
            )
            chain = np.concatenate([np.array(filler[: min_chain - len(chain)], dtype=np.int64), chain])
        chain_logits, chain_hidden = run(chain)
        split = len(chain) - 8
        rng = np.random.default_rng(seed)
        parents = np.array(TREE_PARENTS)
        tokens = np.zeros(len(parents), dtype=np.int64)
        for i, par in enumerate(parents):  # distinct tokens among siblings
            taken = {int(tokens[j]) for j in range(i) if parents[j] == par}
            t = int(rng.integers(3, cfg.vocab_size))
            while t in taken:
                t = int(rng.integers(3, cfg.vocab_size))
            tokens[i] = t
        quality = _torch_quality_set(lm, tokenizer, cfg.vocab_size, primary)
        tree_logits, tree_hidden = [], []
        past = chain[:split]
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(int(tokens[j]))
                j = int(parents[j])
            lg, hd = run(np.concatenate([past, path[::-1]]))
            tree_logits.append(lg[-1])
            tree_hidden.append(hd[-1])
    finally:
        cfg._attn_implementation = prev
    return Reference(
        prompts,
        greedy,
        chain,
        split,
        chain_logits,
        chain_hidden,
        tokens,
        parents,
        np.stack(tree_logits),
        np.stack(tree_hidden),
        quality,
    )


def _torch_greedy(lm, prompt: np.ndarray, new_tokens: int, primary: str) -> np.ndarray:
    """transformers' greedy continuation of ``prompt`` over its own KV cache (one prefill, then one
    token per forward: a 24-token reference costs 24 forwards, not 24 prefills)."""
    import torch

    from ..transformers_compat import cache_argument, cache_of

    ids, past, out = torch.tensor(prompt, dtype=torch.long)[None], None, []
    cache = cache_argument(lm)
    with torch.no_grad():
        for _ in range(new_tokens):
            kw = {"inputs_embeds": lm.get_input_embeddings()(ids)} if primary == "inputs_embeds" else {"input_ids": ids}
            res = lm(**kw, **{cache: past}, use_cache=True)
            past = cache_of(res)
            ids = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids[0, 0]))
    return np.array(out, dtype=np.int64)


def _torch_quality_set(lm, tokenizer, vocab: int, primary: str) -> "QualitySet":
    """The quality texts and torch fp32's greedy continuation of each (QUALITY_TOKENS), all texts
    in one left-padded batch over the KV cache: 64 forwards instead of 2,048."""
    import torch

    from ..transformers_compat import cache_argument, cache_of
    from .quality_texts import TEXTS

    if tokenizer is not None:
        prompts = [
            tokenizer(t, add_special_tokens=False)["input_ids"][:QUALITY_PROMPT_TOKENS] or [1] for _, _, t in TEXTS
        ]
        source = f"spec-bench x{len(TEXTS)} (quality_texts.py)"
    else:
        prompts = [list(np.random.default_rng(q).integers(3, vocab, QUALITY_PROMPT_TOKENS)) for q, _, _ in TEXTS]
        source = f"random ids x{len(TEXTS)} (no tokenizer)"
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    past, out, cache = None, [], cache_argument(lm)
    # only the last position's logits are read: the prefill's lm-head over every prompt position
    # (32 x 128 rows of a 49k vocabulary on SmolLM2) is skipped where the model takes logits_to_keep
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(lm.forward).parameters else {}
    with torch.no_grad():
        for _ in range(QUALITY_TOKENS):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
            kw = {"inputs_embeds": lm.get_input_embeddings()(ids)} if primary == "inputs_embeds" else {"input_ids": ids}
            res = lm(**kw, **keep, attention_mask=mask, position_ids=pos, use_cache=True, **{cache: past})
            past = cache_of(res)
            ids = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids[:, 0].numpy())
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    conts = np.stack(out, axis=1).astype(np.int64)
    return QualitySet([np.array(p, dtype=np.int64) for p in prompts], list(conts), source)
