"""Validation gates, the way speculative decoding needs them.

(a) fp32 parity with torch: logits and hidden states for a chain (prefill, then a chunk over a
    past) and for a real tree (each node equals its root->node path run as a plain chain by
    transformers itself, with its own causal / sliding-window masks; siblings never see each other).
(b) teacher-forced top-1 agreement with torch fp32's greedy continuation of real prompts.
(c) batched-vs-incremental: N tokens in one forward pick the argmaxes of N single steps.
(d) quality: teacher-forced top-1 agreement with the fp32 export and mean KL(fp32 || variant) over
    a fixed text set (32 Spec-Bench texts, fp32's 64-token continuations), against floors.

Torch computes the references once at export time (``reference.npz``); the ORT side is torch-free,
so ``quant-only`` re-validates from the saved references.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..log import logger
from ..runtime.session import empty_past
from ..runtime.tree import causal_inputs, step_inputs
from ..schema import KV_WRITE_INDEX, ROW_SLOTS, SLOT_ROWS, Contract, in_place

# Teacher-forced top-1 floors against torch's greedy continuations of the 4 gate prompts (96
# positions on a real build): a coarse check that each variant runs the model at all.
FLOORS = {"fp32": 0.98, "int8": 0.85, "int4": 0.70}
# Quality floors: top-1 agreement with the fp32 export over the quality set (32 texts x 64 tokens,
# 2,048 positions), set a little under what the quantizer reaches on fast, row-count-exact kernels
# (measured, CPU, onnxruntime 1.32): int8 0.977 SmolLM2-135M / 0.990 Gemma-3-270M; int4 0.773 /
# 0.892. SmolLM2's GGUF is Q4_1, whose float block minimum the fast MatMulNBits kernels cannot hold
# (exact float zero points reach 0.989 but run ~12x slower), so its 4-bit form rounds a second time.
QUALITY_FLOORS = {"fp32": 0.99, "int8": 0.96, "int4": 0.75}
QUALITY_TOKENS = 64              # fp32 greedy continuation per text, every position scored
QUALITY_PROMPT_TOKENS = 128      # each text cut to this many tokens
TREE_PARENTS = [-1, -1, 0, 0, 2, 1, 4]   # siblings at two levels, a deep branch, a cousin
PROMPTS = [
    "Translate to French: The weather is lovely today and we are going to the beach.",
    "Summarize: Speculative decoding drafts several tokens cheaply and verifies them in one forward pass of the large model, keeping the output identical.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: A train travels 120 km in 1.5 hours. What is its average speed? Answer step by step.",
]
LONG_TEXT = ("The history of computing is a story of layers: hardware, operating systems, compilers and "
             "languages, each hiding the complexity beneath it so that people can build the next layer. ")


@dataclass
class Reference:
    prompts: list[np.ndarray]
    greedy: list[np.ndarray]
    chain_ids: np.ndarray          # the chain parity sequence
    chain_split: int               # prefill length; the rest is one chunk over that past
    chain_logits: np.ndarray       # torch logits at every position of chain_ids [T, V]
    chain_hidden: np.ndarray       # torch hidden states [T, H]
    tree_tokens: np.ndarray        # tree node tokens (node 0 = root = last past token's successor)
    tree_parents: np.ndarray
    tree_logits: np.ndarray        # torch logits of each node's root->node path run as a chain
    tree_hidden: np.ndarray
    quality: "QualitySet | None" = None   # the quality texts and torch's greedy continuations

    def save(self, path: Path) -> None:
        q: dict[str, Any] = {}
        if self.quality is not None:
            q = {"quality_prompts": np.concatenate(self.quality.prompts),
                 "quality_prompt_lens": [len(p) for p in self.quality.prompts],
                 "quality_continuations": np.stack(self.quality.continuations),
                 "quality_source": np.array(self.quality.source)}
        np.savez_compressed(
            path, **q, prompt_concat=np.concatenate(self.prompts), prompt_lens=[len(p) for p in self.prompts],
            greedy=np.stack(self.greedy), chain_ids=self.chain_ids, chain_split=self.chain_split,
            chain_logits=self.chain_logits.astype(np.float32), chain_hidden=self.chain_hidden.astype(np.float32),
            tree_tokens=self.tree_tokens, tree_parents=self.tree_parents,
            tree_logits=self.tree_logits.astype(np.float32), tree_hidden=self.tree_hidden.astype(np.float32))

    @classmethod
    def load(cls, path: Path) -> "Reference":
        z = np.load(path)
        offs = np.cumsum(np.r_[0, z["prompt_lens"]])
        prompts = [z["prompt_concat"][offs[i]:offs[i + 1]] for i in range(len(offs) - 1)]
        quality = None
        if "quality_prompts" in z:          # builds before the quality gate have none: it is made then
            qo = np.cumsum(np.r_[0, z["quality_prompt_lens"]])
            quality = QualitySet([z["quality_prompts"][qo[i]:qo[i + 1]] for i in range(len(qo) - 1)],
                                 list(z["quality_continuations"]), str(z["quality_source"]))
        return cls(prompts, list(z["greedy"]), z["chain_ids"], int(z["chain_split"]), z["chain_logits"],
                   z["chain_hidden"], z["tree_tokens"], z["tree_parents"], z["tree_logits"], z["tree_hidden"],
                   quality)


def compute_reference(model, recipe, tokenizer, *, hidden_layer: int = -1, new_tokens: int = 24,
                      min_chain: int = 48, seed: int = 0, primary: str = "input_ids") -> Reference:
    """Torch fp32 references, with transformers' own masks (eager attention), never our wrapper."""
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
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] if tokenizer is not None else \
                list(np.random.default_rng(len(text)).integers(3, cfg.vocab_size, 12))
            prompts.append(np.array(ids[:96] or [1], dtype=np.int64))
        greedy = [_torch_greedy(lm, p, new_tokens, primary) for p in prompts]
        chain = np.concatenate([prompts[0], greedy[0]])
        if len(chain) < min_chain:
            filler = tokenizer(LONG_TEXT * (1 + min_chain // 20), add_special_tokens=False)["input_ids"] \
                if tokenizer is not None else list(np.random.default_rng(1).integers(3, cfg.vocab_size, min_chain))
            chain = np.concatenate([np.array(filler[:min_chain - len(chain)], dtype=np.int64), chain])
        chain_logits, chain_hidden = run(chain)
        split = len(chain) - 8
        rng = np.random.default_rng(seed)
        parents = np.array(TREE_PARENTS)
        tokens = np.zeros(len(parents), dtype=np.int64)
        for i, par in enumerate(parents):      # distinct tokens among siblings
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
    return Reference(prompts, greedy, chain, split, chain_logits, chain_hidden, tokens, parents,
                     np.stack(tree_logits), np.stack(tree_hidden), quality)


def _torch_greedy(lm, prompt: np.ndarray, new_tokens: int, primary: str) -> np.ndarray:
    """transformers' greedy continuation of ``prompt`` over its own KV cache (one prefill, then one
    token per forward: a 24-token reference costs 24 forwards, not 24 prefills)."""
    import torch

    ids, past, out = torch.tensor(prompt, dtype=torch.long)[None], None, []
    with torch.no_grad():
        for _ in range(new_tokens):
            kw = {"inputs_embeds": lm.get_input_embeddings()(ids)} if primary == "inputs_embeds" else {"input_ids": ids}
            res = lm(**kw, past_key_values=past, use_cache=True)
            past = res.past_key_values
            ids = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids[0, 0]))
    return np.array(out, dtype=np.int64)


def _torch_quality_set(lm, tokenizer, vocab: int, primary: str) -> "QualitySet":
    """The quality texts and torch fp32's greedy continuation of each (QUALITY_TOKENS), all texts
    in one left-padded batch over the KV cache: 64 forwards instead of 2,048."""
    import torch

    from .quality_texts import TEXTS

    if tokenizer is not None:
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"][:QUALITY_PROMPT_TOKENS] or [1]
                   for _, _, t in TEXTS]
        source = f"spec-bench x{len(TEXTS)} (quality_texts.py)"
    else:
        prompts = [list(np.random.default_rng(q).integers(3, vocab, QUALITY_PROMPT_TOKENS)) for q, _, _ in TEXTS]
        source = f"random ids x{len(TEXTS)} (no tokenizer)"
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    past, out = None, []
    with torch.no_grad():
        for _ in range(QUALITY_TOKENS):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            kw = {"inputs_embeds": lm.get_input_embeddings()(ids)} if primary == "inputs_embeds" else {"input_ids": ids}
            res = lm(**kw, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True)
            past = res.past_key_values
            ids = res.logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids[:, 0].numpy())
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    conts = np.stack(out, axis=1).astype(np.int64)
    return QualitySet([np.array(p, dtype=np.int64) for p in prompts], list(conts), source)


class Runner:
    """Minimal torch-free forward helper over an ORT decoder session."""

    def __init__(self, session, contract: Contract, embed=None):
        self.s = session
        self.c = contract
        self.embed = embed  # callable ids -> embeds, for inputs_embeds decoders
        self.out_names = [o.name for o in session.get_outputs()]
        self.sparse = SLOT_ROWS in {i.name for i in session.get_inputs()}   # static flavour: rows = slots here

    def forward(self, ids: np.ndarray, pos: np.ndarray, bias: np.ndarray, past: dict):
        """``bias`` is past+new wide. A rowwise graph gets the past arrays and the bias padded to a
        whole number of buffer tiles (what the runtime binds) and its present is cut back."""
        total = bias.shape[-1]
        feeds = dict(past)
        if self.c.kv_layout == "rowwise":
            from ..runtime.decoder import ROWWISE_TILE
            from ..runtime.kv import round_up
            from ..runtime.tree import NEG

            pad = round_up(total, ROWWISE_TILE) - total
            feeds = {k: np.pad(v, ((0, 0), (0, 0), (0, pad + total - v.shape[2]), (0, 0))) for k, v in past.items()}
            bias = np.pad(bias, ((0, 0), (0, 0), (0, 0), (0, pad)), constant_values=NEG)
            feeds[KV_WRITE_INDEX] = np.array([total - len(ids)], np.int64)
        if self.c.primary_input == "inputs_embeds":
            feeds["inputs_embeds"] = self.embed(ids[None])
        else:
            feeds["input_ids"] = ids[None].astype(np.int64)
        feeds["position_ids"] = pos
        feeds["attention_bias"] = bias
        if self.sparse:
            feeds[SLOT_ROWS] = feeds[ROW_SLOTS] = np.arange(len(ids), dtype=np.int64)
        out = dict(zip(self.out_names, self.s.run(None, feeds)))
        keep = total if self.c.kv_layout == "rowwise" else None
        pattern_in, pattern_out = self.c.kv_input_pattern, self.c.kv_output_pattern
        present = {pattern_in.format(i=i, kv=kv): out[pattern_out.format(i=i, kv=kv)][:, :, :keep]
                   for i in range(self.c.num_layers) for kv in ("key", "value")}
        return out["logits"][0], out.get("hidden_states", np.zeros((1, 0)))[0], present

    def prefill(self, ids: np.ndarray):
        pos, bias = causal_inputs(len(ids), 0)
        return self.forward(ids, pos, bias, empty_past(self.c))


def _close(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    diff = float(np.abs(a - b).max())
    return diff, 2e-3 + 1e-4 * float(np.abs(b).max())


def gate_parity(r: Runner, ref: Reference) -> dict:
    """(a) chain and tree parity with torch fp32 (logits and hidden states)."""
    ids, split = ref.chain_ids, ref.chain_split
    lg0, hd0, past = r.prefill(ids[:split])
    pos, bias = causal_inputs(len(ids) - split, split)
    lg1, hd1, _ = r.forward(ids[split:], pos, bias, past)
    logits = np.concatenate([lg0, lg1])
    hidden = np.concatenate([hd0, hd1])
    chain_l, tol_l = _close(logits, ref.chain_logits)
    chain_h, tol_h = _close(hidden, ref.chain_hidden)
    pos, bias = step_inputs(list(map(int, ref.tree_parents)), split)
    tl, th, _ = r.forward(ref.tree_tokens, pos, bias, past)
    tree_l, ttol_l = _close(tl, ref.tree_logits)
    tree_h, ttol_h = _close(th, ref.tree_hidden)
    ok = chain_l <= tol_l and chain_h <= tol_h and tree_l <= ttol_l and tree_h <= ttol_h
    return {"passed": bool(ok), "chain_logits_maxdiff": chain_l, "chain_hidden_maxdiff": chain_h,
            "tree_logits_maxdiff": tree_l, "tree_hidden_maxdiff": tree_h, "tolerance_logits": tol_l,
            "tokens": int(len(ids)), "tree_nodes": int(len(ref.tree_tokens))}


def gate_teacher_forced(r: Runner, ref: Reference, floor: float) -> dict:
    """(b) top-1 agreement with torch fp32's greedy continuation, teacher-forced."""
    agree = total = 0
    for p, g in zip(ref.prompts, ref.greedy):
        seq = np.concatenate([p, g[:-1]])
        lg, _, _ = r.prefill(seq)
        pred = lg[len(p) - 1:].argmax(-1)
        agree += int((pred == g).sum())
        total += len(g)
    rate = agree / max(total, 1)
    return {"passed": bool(rate >= floor), "agree": agree, "total": total, "rate": round(rate, 4), "floor": floor}


BATCH_ROWS = tuple(range(2, 18))     # verify sizes the batched gate checks
BATCH_PASTS = (250, 1018)            # + up to 17 rows: crosses the 256- and 1024-key boundaries


def gate_batched(r: Runner, ref: Reference) -> dict:
    """(c) Every verify size N in 2..17 gives logits BIT-identical (max diff 0.0) to N single steps
    run the way the runtime runs them, over short prompts and over pasts whose new rows cross the
    256- and 1024-key boundaries. That equality is what makes speculative output equal plain
    decoding. ``raw_single_row_maxdiff`` shows why single steps are padded to two rows: the
    one-row kernel path differs in the last bits, and int8 activations amplify it."""
    from ..runtime.decoder import Decoder

    dec = Decoder(r.s, r.c, r.embed)
    limit = r.c.position_limit
    n_max = max(BATCH_ROWS)
    stream = np.concatenate([np.concatenate([p, g]) for p, g in zip(ref.prompts, ref.greedy)] + [ref.chain_ids])
    long = np.resize(stream, max(BATCH_PASTS) + n_max)
    cases = [(np.asarray(p), np.asarray(g[:n_max])) for p, g in zip(ref.prompts, ref.greedy)]
    cases += [(long[:past], long[past:past + n_max]) for past in BATCH_PASTS if past + n_max + 1 <= limit]
    mism = total = 0
    maxdiff = rawdiff = 0.0
    for past, chunk in cases:
        kv = dec.new_cache()
        _, _, pres = dec.forward(past.tolist(), None, kv)
        kv.commit(pres, len(past), list(range(len(past))))
        singles = []
        for t in chunk:                              # single steps (padded), committed one by one
            li, _, pres = dec.forward([int(t)], None, kv)
            kv.commit(pres, 1, [0])
            singles.append(li[0])
        inc = np.stack(singles)
        kv.truncate(len(past))
        for n in (k for k in BATCH_ROWS if k <= len(chunk)):
            lb, _, _ = dec.forward(chunk[:n].tolist(), None, kv)
            mism += int((lb.argmax(-1) != inc[:n].argmax(-1)).sum())
            total += n
            maxdiff = max(maxdiff, float(np.abs(lb - inc[:n]).max()))
        with dec.padding(False):                     # the unpadded one-row path, for the record
            raw, _, _ = dec.forward(chunk[:1].tolist(), None, kv)
        rawdiff = max(rawdiff, float(np.abs(raw[0] - inc[0]).max()))
        kv.release()
    return {"passed": mism == 0 and maxdiff == 0.0, "mismatches": mism, "total": total, "logits_maxdiff": maxdiff,
            "rows": [min(BATCH_ROWS), max(BATCH_ROWS)], "pasts": [len(p) for p, _ in cases],
            "raw_single_row_maxdiff": rawdiff}


def time_forward(session, contract: Contract, *, repeats: int = 12) -> dict:
    """Fastest-of-``repeats`` ms of one forward at N new tokens over a past (the verify cost
    speculative decoding pays), through the runtime's own Decoder, so a static layout is timed
    with its I/O binding. The minimum, not the median: on a shared machine other processes only
    ever add time, and the minimum is what keeps the default variant from flipping with load.
    n1 is the raw one-row path; the runtime pays n2 for a single token (see Decoder.forward)."""
    from ..runtime.decoder import Decoder

    dec = Decoder(session, contract)
    cases = _timing_cases(dec, contract, np.random.default_rng(0))
    out = {key: round(_fastest_ms(dec, n, toks, embeds, kv, repeats, skip=2), 2)
           for key, n, toks, embeds, kv in cases}
    _release(cases)
    return out


def _timing_cases(dec, contract: Contract, rng) -> list[tuple]:
    """``(key, rows, tokens, embeds, kv)`` for 1, 2 and 8 new rows over a random past of 256 and
    1024 positions (where the decoder holds them); one cache per past, shared by its rows."""
    limit = contract.position_limit
    cases = []
    for past_len in (p for p in (256, 1024) if p + 8 < limit):
        kv = dec.new_cache()
        kv.ensure(past_len + 8)
        if in_place(contract.kv_layout):
            kv.buf[:, :, :, :past_len] = rng.standard_normal(kv.buf[:, :, :, :past_len].shape).astype(np.float32)
        else:
            kv.arrays = {k: rng.standard_normal((1, contract.num_kv_heads, past_len, contract.head_dim))
                         .astype(np.float32) for k in kv.names}
        kv.length = past_len
        for n in (1, 2, 8):
            toks = [int(t) for t in rng.integers(0, contract.vocab_size, n)]
            embeds = rng.standard_normal((1, n, contract.hidden_size)).astype(np.float32) \
                if contract.primary_input == "inputs_embeds" else None
            cases.append((f"n{n}_p{past_len}", n, toks, embeds, kv))
    return cases


def _fastest_ms(dec, n: int, toks, embeds, kv, repeats: int, skip: int) -> float:
    """Fastest of ``repeats`` forwards after ``skip`` untimed ones; n == 1 times the raw one-row path."""
    ts = []
    with dec.padding(n != 1):
        for i in range(skip + repeats):
            t0 = time.perf_counter()
            dec.forward(toks, None, kv, embeds=embeds)
            if i >= skip:
                ts.append(time.perf_counter() - t0)
    return 1000 * min(ts)


def _release(cases) -> None:
    for kv in {id(c[4]): c[4] for c in cases}.values():
        kv.release()


@dataclass
class QualitySet:
    """Token ids of the fixed texts and fp32's greedy continuation of each (what is scored)."""

    prompts: list[np.ndarray]
    continuations: list[np.ndarray]
    source: str

    @property
    def positions(self) -> int:
        return int(sum(len(c) for c in self.continuations))

    def fit(self, limit: int) -> "QualitySet":
        """The set cut to sequences of at most ``limit`` positions (a small static buffer, a short
        model): prompts lose their first tokens, then continuations their last. Teacher forcing
        compares variant and fp32 on the same tokens, so the cut texts still measure agreement."""
        if all(len(p) + len(c) - 1 <= limit for p, c in zip(self.prompts, self.continuations)):
            return self
        conts = [c[:max(limit - 1, 1)] for c in self.continuations]
        prompts = [p[-max(limit - len(c) + 1, 1):] for p, c in zip(self.prompts, conts)]
        return QualitySet(prompts, conts, f"{self.source}, cut to {limit} positions")

    def digest(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for p, c in zip(self.prompts, self.continuations):
            h.update(np.asarray(p, np.int64).tobytes() + b"|" + np.asarray(c, np.int64).tobytes() + b"\n")
        return h.hexdigest()[:16]


def quality_prompts(folder: Path, vocab: int, n: int | None = None) -> tuple[list[np.ndarray], str]:
    """The quality texts as token ids (the build's own tokenizer.json; a model without one gets
    fixed random ids), each cut to QUALITY_PROMPT_TOKENS."""
    from .quality_texts import TEXTS

    texts = TEXTS[:n] if n else TEXTS
    tok_file = Path(folder) / "tokenizer.json"
    if tok_file.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
        ids = [tok.encode(t, add_special_tokens=False).ids[:QUALITY_PROMPT_TOKENS] for _, _, t in texts]
        source = f"spec-bench x{len(texts)} (quality_texts.py)"
    else:
        ids = [list(np.random.default_rng(q).integers(3, vocab, QUALITY_PROMPT_TOKENS)) for q, _, _ in texts]
        source = f"random ids x{len(texts)} (no tokenizer.json)"
    return [np.array(i or [1], dtype=np.int64) for i in ids], source


def quality_set(fp32: Runner, prompts: list[np.ndarray], source: str, tokens: int = QUALITY_TOKENS) -> QualitySet:
    """fp32's greedy continuation of each prompt (one prefill, then single steps over the KV cache)."""
    conts = []
    for p in prompts:
        lg, _, past = fp32.prefill(p)
        out = [int(lg[-1].argmax())]
        for _ in range(tokens - 1):
            pos, bias = causal_inputs(1, len(p) + len(out) - 1)
            lg, _, past = fp32.forward(np.array(out[-1:]), pos, bias, past)
            out.append(int(lg[-1].argmax()))
        conts.append(np.array(out, dtype=np.int64))
    return QualitySet(prompts, conts, source)


def scoring_set(folder: Path, fp32: Runner, ref: Reference | None, limit: int | None = None) -> QualitySet:
    """What the quality gate scores for the build in ``folder``: the set saved with its torch
    reference, else fp32's own continuations of the quality texts; cut to ``limit`` positions.
    The build's gate and the bench's peer score (bench.genai.peer_quality) read it from here."""
    qs = (ref.quality if ref is not None else None) or quality_set(fp32, *quality_prompts(folder, fp32.c.vocab_size))
    return qs.fit(limit) if limit else qs


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def gate_quality(fp32: Runner, runners: dict[str, Runner], qs: QualitySet, floors: dict[str, float]) -> dict[str, dict]:
    """Teacher-forced over the quality set: each variant's top-1 agreement with the fp32 export and
    the mean KL(fp32 || variant) of the next-token distributions, at every continuation position.
    Text by text, so fp32's logits are computed once and never all held."""
    agree = dict.fromkeys(runners, 0)
    kl = dict.fromkeys(runners, 0.0)
    for p, c in zip(qs.prompts, qs.continuations):
        seq = np.concatenate([p, c[:-1]])
        sl = slice(len(p) - 1, len(seq))
        ref = _log_softmax(fp32.prefill(seq)[0][sl])
        top = ref.argmax(-1)
        pref = np.exp(ref)
        for name, r in runners.items():
            lq = _log_softmax(r.prefill(seq)[0][sl])
            agree[name] += int((lq.argmax(-1) == top).sum())
            kl[name] += float((pref * (ref - lq)).sum())
    n = qs.positions
    out = {}
    for name in runners:
        precision = name.split("-")[0]
        floor = floors.get(precision, floors.get("int4", 0.0))
        rate = agree[name] / max(n, 1)
        out[name] = {"passed": bool(rate >= floor), "top1": round(rate, 4), "agree": agree[name], "positions": n,
                     "mean_kl": round(kl[name] / max(n, 1), 5), "floor": floor, "texts": len(qs.prompts),
                     "set": qs.source, "set_sha256": qs.digest()}
    return out


TIMING_KEYS = ("n2_p256", "n8_p256", "n2_p1024", "n8_p1024")


def timing_keys(dec) -> tuple[str, ...]:
    """What a variant is judged on: a single-token step as the runtime runs it (two rows, or one
    on a rowwise graph) and an 8-row verify, at pasts 256 and 1024."""
    return tuple(k.replace("n2_", "n1_") for k in TIMING_KEYS) if dec.rowwise else TIMING_KEYS


def time_interleaved(sessions: dict[str, tuple], *, rounds: int = 5, repeats: int = 6) -> dict[str, dict]:
    """Forward timings of several variants, interleaved: every round times every variant at every
    (rows, past) once, fastest of ``repeats``; so load that comes and goes hits them all alike.
    Returns per variant the fastest over all rounds per key (ms) and the per-round cost (mean over
    TIMING_KEYS present) from which the picker reads the noise."""
    from ..runtime.decoder import Decoder

    rng = np.random.default_rng(0)
    plans = {}
    for name, (session, contract) in sessions.items():
        dec = Decoder(session, contract)
        plans[name] = (dec, _timing_cases(dec, contract, rng))
    for dec, cases in plans.values():          # warm-up: first runs grow arenas and fault pages in
        for _, n, toks, embeds, kv in cases:
            with dec.padding(n != 1):
                dec.forward(toks, None, kv, embeds=embeds)
    best: dict[str, dict[str, float]] = {n: {} for n in sessions}
    per_round: dict[str, list[float]] = {n: [] for n in sessions}
    for _ in range(rounds):
        for name, (dec, cases) in plans.items():
            this = {}
            for key, n, toks, embeds, kv in cases:
                this[key] = _fastest_ms(dec, n, toks, embeds, kv, repeats, skip=1)
                best[name][key] = round(min(best[name].get(key, 1e9), this[key]), 3)
            keys = [k for k in timing_keys(dec) if k in this]
            per_round[name].append(round(float(np.mean([this[k] for k in keys])), 3))
    for _, cases in plans.values():
        _release(cases)
    return {n: {"timings_ms": best[n], "round_costs_ms": per_round[n]} for n in sessions}


def run_gates(variant: str, session, contract: Contract, ref: Reference, *, embed=None,
              timing: bool = True) -> dict:
    r = Runner(session, contract, embed)
    gates = {}
    if variant == "fp32":
        gates["parity"] = gate_parity(r, ref)
    gates["teacher_forced"] = gate_teacher_forced(r, ref, FLOORS.get(variant, 0.7))
    gates["batched_vs_incremental"] = gate_batched(r, ref)
    res = {"gates": gates, "passed": all(g["passed"] for g in gates.values())}
    if timing:
        res["timings_ms"] = time_forward(session, contract)
    for name, g in gates.items():
        logger.debug("  %s %s: %s", variant, name, g)
    return res
