"""Spike (docs/speed.md): decode steps of 1/2/4/8 rows, the entry's int8-static decoder against the
Q41MatMul graph (q41_graph.py), interleaved, 2 threads; then a lone token's logits against the
same token as the first row of 2/3/5/8-row chains (bit-equal or not). Measurement code."""
import time
import numpy as np
from dejavuu_build.runtime import load
from dejavuu_build.runtime.decoder import Decoder
from q41_common import ENTRY, THREADS, session

base = load(str(ENTRY), variant="int8-static", threads=THREADS)
dq = Decoder(session(), base.contract, base.decoder.embed)
decs = {"int8-static": base.decoder, "q41-custom": dq}
V = base.contract.vocab_size
rng = np.random.default_rng(0)


def prefilled(d, prompt):
    kv = d.new_cache()
    for i in range(0, len(prompt), 128):
        part = prompt[i : i + 128]
        _, _, pr = d.prefill(part, kv, len(prompt), 16)
        kv.commit(pr, len(part), list(range(len(part))))
    return kv


for PAST in (64, 256, 1000):
    prompt = rng.integers(0, V, PAST).tolist()
    kvs = {k: prefilled(d, prompt) for k, d in decs.items()}
    toks = rng.integers(0, V, 8).tolist()
    res = {}
    for r in range(7):
        for k, d in list(decs.items()) if r % 2 else list(decs.items())[::-1]:
            for n in (1, 2, 4, 8):
                best = 1e9
                for _ in range(8):
                    t0 = time.perf_counter()
                    d.forward(toks[:n], None, kvs[k], copy=False)
                    best = min(best, time.perf_counter() - t0)
                res.setdefault((k, n), []).append(best * 1e3)
    for k in decs:
        one = np.median(res[(k, 1)])
        print(f"past {PAST} {k:12s} " + " ".join(f"{n}:{np.median(res[(k, n)]):.2f}" for n in (1, 2, 4, 8)) + f"  8/1 {np.median(res[(k, 8)]) / one:.2f}", flush=True)
    for kv in kvs.values():
        kv.release()

# losslessness: a token's logits alone vs as the first row of 2..8-row chains
prompt = rng.integers(0, V, 300).tolist()
same = 0
for n in (2, 3, 5, 8):
    kv1, kvn = prefilled(dq, prompt), prefilled(dq, prompt)
    toks = rng.integers(0, V, n).tolist()
    a = np.asarray(dq.forward(toks[:1], None, kv1)[0]).reshape(-1)
    b = np.asarray(dq.forward(toks, None, kvn)[0])[0]
    same += np.array_equal(a, b)
    kv1.release()
    kvn.release()
print(f"lone vs first of n rows bit-equal: {same}/4")
