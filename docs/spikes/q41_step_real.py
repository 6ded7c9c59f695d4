"""Spike (docs/speed.md): q41_step.py on the file's own Q4_1 blocks, plus a lone token's logits
against the same token as the first row of 2/3/5/8-row chains (bit-equal or not)."""
import os, time, numpy as np, onnxruntime as ort
from dejavuu_build.runtime import load
from dejavuu_build.runtime.decoder import Decoder
from dejavuu_build.errors import ContractError
base = load("smollm2-s22b", variant="int8-static", threads=2)
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.inter_op_num_threads = 1; so.log_severity_level = 3
so.add_session_config_entry("session.intra_op.allow_spinning", "1")
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.register_custom_ops_library("/tmp/s23/op/libq41op.so")
qs = ort.InferenceSession("/tmp/s23/op/q41_real.onnx", so, providers=["CPUExecutionProvider"])
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
# losslessness on the real weights: a token's logits alone vs as the first row of 2..8-row chains
prompt = rng.integers(0, V, 300).tolist()
bad = tot = 0
for n in (2, 3, 5, 8):
    kv1, kvn = dq.new_cache(), dq.new_cache()
    for kv in (kv1, kvn):
        for i in range(0, 300, 128):
            part = prompt[i:i+128]; lg, _, pr = dq.prefill(part, kv, 300, 16); kv.commit(pr, len(part), list(range(len(part))))
    toks = rng.integers(0, V, n).tolist()
    a = np.asarray(dq.forward(toks[:1], None, kv1)[0]).reshape(-1)
    b = np.asarray(dq.forward(toks, None, kvn)[0])[0]
    tot += 1; bad += not np.array_equal(a, b)
    kv1.release(); kvn.release()
print(f"lone vs first of n rows bit-equal: {tot - bad}/{tot}")
