"""Spike (docs/speed.md): decode steps of 1/2/4/8 rows, the int8-static decoder against the same
graph on the Q41MatMul custom op (q41_surgery.py), interleaved, 2 threads. Measurement code."""
import os, time, numpy as np, onnxruntime as ort
from dejavuu_build.runtime import load
from dejavuu_build.runtime.decoder import Decoder
from dejavuu_build.errors import ContractError
base = load("smollm2-s22b", variant="int8-static", threads=2)
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.inter_op_num_threads = 1; so.log_severity_level = 3
so.add_session_config_entry("session.intra_op.allow_spinning", "1")
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.register_custom_ops_library("/tmp/s23/op/libq41op.so")
qs = ort.InferenceSession("/tmp/s23/op/q41_static.onnx", so, providers=["CPUExecutionProvider"])
dq = Decoder(qs, base.contract, base.decoder.embed)
decs = {"int8-static": base.decoder, "q41-custom": dq}
V = 49152; rng = np.random.default_rng(0)
for PAST in (64, 256, 1000):
    prompt = rng.integers(0, V, PAST).tolist()
    kvs = {}
    for k, d in decs.items():
        kv = d.new_cache()
        for i in range(0, PAST, 128):
            part = prompt[i:i+128]; lg, _, pr = d.prefill(part, kv, PAST, 16); kv.commit(pr, len(part), list(range(len(part))))
        kvs[k] = kv
    toks = rng.integers(0, V, 8).tolist()
    res = {}
    for r in range(7):
        for k, d in (list(decs.items()) if r % 2 else list(decs.items())[::-1]):
            for n in (1, 2, 4, 8):
                best = 1e9
                for _ in range(8):
                    t0 = time.perf_counter(); d.forward(toks[:n], None, kvs[k], copy=False); best = min(best, time.perf_counter() - t0)
                res.setdefault((k, n), []).append(best * 1e3)
    for k in decs:
        one = np.median(res[(k, 1)])
        print(f"past {PAST} {k:12s} " + " ".join(f"{n}:{np.median(res[(k, n)]):.2f}" for n in (1, 2, 4, 8)) + f"  8/1 {np.median(res[(k, 8)])/one:.2f}", flush=True)
    for kv in kvs.values(): kv.release()
