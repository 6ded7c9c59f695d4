"""Spike (docs/speed.md), same run: the entry's int8-static, the Q41MatMul graph (q41_graph.py) and
genai's int4 / int8 builds, plain (ours: plain and auto, each output checked against its own plain
decoding), PER held-out prompts per category (--skip 10's), interleaved per prompt on the same
token ids; decode tok/s = tokens / (total - prefill)."""
import os
import numpy as np
from dejavuu_build.runtime import load
from dejavuu_build.bench.config import read_prompts, select, resolve_data
from dejavuu_build.bench.runner import as_prompt
from dejavuu_build.bench.genai import load_genai_peer
from dejavuu_build.precisions import INT4, INT8
from q41_common import ENTRY, THREADS, q41_model
st = load(str(ENTRY), threads=THREADS)
q4 = q41_model()
g4, g8 = (load_genai_peer(st.manifest, THREADS, st.eos_ids, precision=p)[0] for p in (INT4, INT8))
N = int(os.environ.get("PER", "2"))
ps = select(read_prompts(resolve_data(None)), "translation,summarization,qa,math_reasoning,rag,mt_bench".split(","), N, skip=10)
ours = {"int8-static": st, "q41-op": q4}
for m in ours.values():
    for meth in ("baseline", "auto"): m.generate("Warm up: say hello.", method=meth, max_new_tokens=8)
for g in (g4, g8): g.generate(list(range(8)), 4)
res, equal = {}, {}
for i, p in enumerate(ps):
    ids = st.encode(as_prompt(st, [{"role": "user", "content": p.turns[0]}]))
    items = [("int8-static", None), ("q41-op", None), ("genai", g4), ("genai-int8", g8)]
    for name, peer in (items if i % 2 == 0 else items[::-1]):
        if peer is not None:
            r = peer.generate(ids, 128)
            res.setdefault((name, "plain"), []).append(len(r.tokens) / (r.total_s - r.prefill_s))
            continue
        m = ours[name]
        for meth in ("baseline", "auto"):
            r = m.generate(as_prompt(m, [{"role": "user", "content": p.turns[0]}]), method=meth, max_new_tokens=128)
            res.setdefault((name, "plain" if meth == "baseline" else "auto"), []).append(len(r.tokens) / (r.stats.total_s - r.stats.prefill_s))
            if meth == "baseline":
                plain = list(r.tokens)
            equal.setdefault((name, meth), []).append(list(r.tokens) == plain)
ref = res[("genai", "plain")]
for k, x in sorted(res.items()):
    print(f"{k[0]:12s} {k[1]:6s} decode tok/s {np.exp(np.mean(np.log(x))):.1f}  x genai int4 {np.exp(np.mean([np.log(a / b) for a, b in zip(x, ref)])):.3f}")
for (name, meth), x in sorted(equal.items()):
    print(f"{name:12s} {meth:9s} equal to its own plain decoding {sum(x)}/{len(x)}")
