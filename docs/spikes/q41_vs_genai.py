"""Spike (docs/speed.md), same run: int8-static, the Q41MatMul graph (file's Q4_1 blocks) and genai int4 / int8 plain, on 12
held-out prompts, interleaved per prompt; decode tok/s = tokens / (total - prefill)."""
import time, numpy as np, onnxruntime as ort
from pathlib import Path
from dejavuu_build.runtime import load
from dejavuu_build.runtime.decoder import Decoder
from dejavuu_build.bench.config import read_prompts, select, resolve_data
from dejavuu_build.bench.runner import as_prompt
from dejavuu_build.bench.genai import GenaiPeer
st = load("smollm2-s22b", threads=2)
q4 = load("smollm2-s22b", threads=2)
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.inter_op_num_threads = 1; so.log_severity_level = 3
so.add_session_config_entry("session.intra_op.allow_spinning", "1")
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.register_custom_ops_library("/tmp/s23/op/libq41op.so")
q4.decoder = Decoder(ort.InferenceSession("/tmp/s23/op/q41_real.onnx", so, providers=["CPUExecutionProvider"]), q4.contract, q4.decoder.embed)
peers = Path.home() / ".cache/dejavuu/.peers"
g4 = GenaiPeer(next(peers.glob("genai0.18.0-int4-cpu-2a6fce1a843366a9")), 2, st.eos_ids)
g8 = GenaiPeer(next(peers.glob("genai0.18.0-int8-cpu-2a6fce1a843366a9")), 2, st.eos_ids, name="genai-int8")
N = int(__import__("os").environ.get("PER", "2"))
ps = select(read_prompts(resolve_data(None)), "translation,summarization,qa,math_reasoning,rag,mt_bench".split(","), N, skip=10)
ours = {"int8-static": st, "q41-op": q4}
for m in ours.values():
    for meth in ("baseline", "auto"): m.generate("Warm up: say hello.", method=meth, max_new_tokens=8)
for g in (g4, g8): g.generate(list(range(8)), 4)
res = {}
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
ref = res[("genai", "plain")]
for k, x in sorted(res.items()):
    print(f"{k[0]:12s} {k[1]:6s} decode tok/s {np.exp(np.mean(np.log(x))):.1f}  x genai int4 {np.exp(np.mean([np.log(a / b) for a, b in zip(x, ref)])):.3f}")
