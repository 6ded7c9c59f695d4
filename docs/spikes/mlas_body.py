"""The counterpart of q41_gemm.cpp through onnxruntime: SmolLM2-135M's 120 body products as
MatMulNBits nodes (8-bit and 4-bit blocks of 32, accuracy level 4) of one graph, 2 threads, timed
at 1, 2, 4 and 8 rows (docs/speed.md, twenty-second session). Measurement code."""

import numpy as np, onnxruntime as ort, time, sys
from onnx import helper, TensorProto, numpy_helper
L = int(sys.argv[1]) if len(sys.argv) > 1 else 30
shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * L
def model(bits):
    nodes, inits, outs = [], [], []
    for i, (K, N) in enumerate(shapes):
        q = np.random.randint(0, 255, (N, K // 32, 32 * bits // 8), dtype=np.uint8)
        s = np.random.rand(N, K // 32).astype(np.float32) * 0.01
        inits += [numpy_helper.from_array(q, f"q{i}"), numpy_helper.from_array(s, f"s{i}")]
        nodes.append(helper.make_node("MatMulNBits", ["x576" if K == 576 else "x1536", f"q{i}", f"s{i}"], [f"y{i}"], domain="com.microsoft", K=K, N=N, bits=bits, block_size=32, accuracy_level=4))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", N]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x576", TensorProto.FLOAT, ["M", 576]), helper.make_tensor_value_info("x1536", TensorProto.FLOAT, ["M", 1536])], outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
ss = {"mlas8": model(8), "mlas4 (sym, not Q4_1)": model(4)}
for M in (1, 2, 4, 8):
    feeds = {"x576": np.random.rand(M, 576).astype(np.float32), "x1536": np.random.rand(M, 1536).astype(np.float32)}
    for k, s in ss.items():
        ts = []
        for _ in range(40):
            t0 = time.perf_counter(); s.run(None, feeds); ts.append(time.perf_counter() - t0)
        print(f"M={M} {k}: body {np.median(ts)*1e3:.3f} ms")
