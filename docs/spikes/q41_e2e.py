"""Spike (docs/speed.md): whole generations on 12 held-out Spec-Bench prompts, int8-static against
the Q41MatMul graph on the file's Q4_1 blocks, plain and auto, interleaved; every output checked
against its own plain decoding."""
import time, numpy as np, onnxruntime as ort
from dejavuu_build.runtime import load
from dejavuu_build.runtime.decoder import Decoder
from dejavuu_build.bench.config import read_prompts, select, resolve_data
from dejavuu_build.bench.runner import as_prompt
st = load("smollm2-s22b", threads=2)
q4 = load("smollm2-s22b", threads=2)
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.inter_op_num_threads = 1; so.log_severity_level = 3
so.add_session_config_entry("session.intra_op.allow_spinning", "1")
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.register_custom_ops_library("/tmp/s23/op/libq41op.so")
q4.decoder = Decoder(ort.InferenceSession("/tmp/s23/op/q41_real.onnx", so, providers=["CPUExecutionProvider"]), q4.contract, q4.decoder.embed)
ps = select(read_prompts(resolve_data(None)), "translation,summarization,qa,math_reasoning,rag,mt_bench".split(","), 2, skip=10)
models = {"int8-static": st, "q41-op": q4}
for m in models.values():
    for meth in ("baseline", "auto"): m.generate("Warm up: say hello.", method=meth, max_new_tokens=8)
res = {}
for i, p in enumerate(ps):
    for name, m in (list(models.items()) if i % 2 == 0 else list(models.items())[::-1]):
        pr = as_prompt(m, [{"role": "user", "content": p.turns[0]}])
        base = None
        for meth in ("baseline", "auto"):
            r = m.generate(pr, method=meth, max_new_tokens=128)
            dec = r.stats.total_s - r.stats.prefill_s
            if meth == "baseline": base = list(r.tokens)
            res.setdefault((name, meth), []).append((len(r.tokens) / dec, list(r.tokens) == base, r.stats.prefill_s, p.category))
for (name, meth), x in sorted(res.items()):
    ref = res[("int8-static", "baseline")]
    geo = np.exp(np.mean([np.log(a[0] / b[0]) for a, b in zip(x, ref)]))
    print(f"{name:12s} {meth:9s} decode tok/s x int8-static plain {geo:.3f}  equal to own plain {sum(a[1] for a in x)}/{len(x)}  prefill ms {1e3*np.mean([a[2] for a in x]):.0f}")
