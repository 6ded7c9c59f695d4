"""Spike (docs/speed.md): SmolLM2's int8-static decoder with each body MatMulNBits replaced by the
Q41MatMul custom op of q41_op.cpp, random Q4_1 weights of the same shapes (timing only).
Measurement code."""
import numpy as np, onnx, sys
from onnx import helper, numpy_helper
from dejavuu_build.export.fp16_store import load_unpacked
src = "/root/.cache/dejavuu/smollm2-s22b/decoder_int8-static.onnx"
m = load_unpacked(src)
g = m.graph
rng = np.random.default_rng(0)
new_nodes, n_rep = [], 0
drop_inits = set()
for n in g.node:
    if n.op_type == "MatMulNBits" and "lm_head" not in n.name:
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        K, N = int(a["K"]), int(a["N"])
        nb, tiles = K // 32, N // 16
        base = n.name.replace("/", "_")
        q = rng.integers(0, 256, tiles * nb * 256, dtype=np.uint8)
        d = (rng.random(tiles * nb * 16, dtype=np.float32) * 0.01 + 0.005).astype(np.float32)
        mm = (-(rng.random(tiles * nb * 16, dtype=np.float32) * 0.1 + 0.05)).astype(np.float32)
        for nm, arr in ((base + ".q41q", q), (base + ".q41d", d), (base + ".q41m", mm)):
            g.initializer.append(numpy_helper.from_array(arr, nm))
        drop_inits |= set(n.input[1:])
        new_nodes.append(helper.make_node("Q41MatMul", [n.input[0], base + ".q41q", base + ".q41d", base + ".q41m"], list(n.output), name=n.name + "/q41", domain="dejavuu.q41", K=K, N=N))
        n_rep += 1
    else:
        new_nodes.append(n)
del g.node[:]; g.node.extend(new_nodes)
used = {i for n in g.node for i in n.input}
for t in [t for t in g.initializer if t.name not in used]: g.initializer.remove(t)
m.opset_import.append(helper.make_opsetid("dejavuu.q41", 1))
onnx.save(m, "/tmp/s23/op/q41_static.onnx", save_as_external_data=True, location="q41_static.onnx.data")
print("replaced", n_rep)
