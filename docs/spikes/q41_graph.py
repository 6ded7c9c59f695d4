"""Spike (docs/speed.md): the entry's int8-static graph with each body MatMulNBits replaced by the
Q41MatMul operator of q41_op.cpp, on the GGUF's own Q4_1 blocks (found through
quantize.gguf_blocks), or with --random on random levels of the same shapes (timing only).
Writes Q41_GRAPH (q41_common.py). Measurement code."""
import json, re, sys
import numpy as np, onnx
from onnx import helper, numpy_helper
from dejavuu_build.export.fp16_store import load_unpacked
from dejavuu_build.quantize.gguf_blocks import GGUFBlocks
from q41_common import ENTRY as E, GRAPH
RANDOM = "--random" in sys.argv
man = json.load(open(E / "manifest.json"))
if not RANDOM:
    gb = GGUFBlocks(man["source"]["path"])
    fp = load_unpacked(E / "decoder_fp32.onnx")
    W = {t.name: t for t in fp.graph.initializer}
rng = np.random.default_rng(0)
def blocks(name):
    w = numpy_helper.to_array(W[name]).astype(np.float32)  # [K, N]
    found = gb.find(np.ascontiguousarray(w.T))
    assert found is not None, name
    return found[1]
m = load_unpacked(E / "decoder_int8-static.onnx")
g = m.graph
SUBS = {"q_proj_k_proj_v_proj": ["q_proj", "k_proj", "v_proj"], "gate_proj_up_proj": ["gate_proj", "up_proj"], "o_proj": ["o_proj"], "down_proj": ["down_proj"]}
new, n_rep = [], 0
for n in g.node:
    if n.op_type == "MatMulNBits" and "lm_head" not in n.name:
        mt = re.match(r"/model/layers\.(\d+)/(self_attn|mlp)/(\w+)/MatMulNBits", n.name)
        L, part, proj = mt.groups()
        a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
        if RANDOM:
            N, nb = int(a["N"]), int(a["K"]) // 32
            q = rng.integers(0, 16, (N, nb, 32), dtype=np.uint8)
            sc = rng.random((N, nb), dtype=np.float32) * 0.01 + 0.005
            off = -(rng.random((N, nb), dtype=np.float32) * 0.1 + 0.05)
        else:
            bs = [blocks(f"model.layers.{L}.{part}.{s}.weight_T") for s in SUBS[proj]]
            assert all(b.kind == "Q4_1" for b in bs), [b.kind for b in bs]
            q = np.concatenate([b.q for b in bs]); sc = np.concatenate([b.scale for b in bs]); off = np.concatenate([b.offset for b in bs])
        N, nb, _ = q.shape; tiles = N // 16
        qt = q.reshape(tiles, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4)
        packed = (qt[:, :, :4] | (qt[:, :, 4:] << 4)).astype(np.uint8).reshape(-1)
        d = sc.reshape(tiles, 16, nb).transpose(0, 2, 1).reshape(-1).astype(np.float32)
        mm = off.reshape(tiles, 16, nb).transpose(0, 2, 1).reshape(-1).astype(np.float32)
        base = n.name.replace("/", "_")
        for nm, arr in ((base + ".q41q", packed), (base + ".q41d", d), (base + ".q41m", mm)):
            g.initializer.append(numpy_helper.from_array(arr, nm))
        assert int(a["N"]) == N and int(a["K"]) == nb * 32
        new.append(helper.make_node("Q41MatMul", [n.input[0], base + ".q41q", base + ".q41d", base + ".q41m"], list(n.output), name=n.name + "/q41", domain="dejavuu.q41", K=nb * 32, N=N))
        n_rep += 1
    else:
        new.append(n)
del g.node[:]; g.node.extend(new)
used = {i for n in g.node for i in n.input}
for t in [t for t in g.initializer if t.name not in used]: g.initializer.remove(t)
m.opset_import.append(helper.make_opsetid("dejavuu.q41", 1))
onnx.save(m, GRAPH, save_as_external_data=True, location=GRAPH.rsplit("/", 1)[-1] + ".data")
print("replaced", n_rep, "with", "random levels" if RANDOM else "the file's Q4_1 blocks", "->", GRAPH)
