"""Spike (docs/speed.md): the quality gate's teacher-forced top-1 and KL against fp32 for the
Q41MatMul graph on the file's own Q4_1 blocks (q41_graph.py), int8-static and int4-static."""
from dejavuu_build import schema as S
from dejavuu_build.build.quality import gate_quality, scoring_set
from dejavuu_build.build.runner import Runner
from dejavuu_build.build.validation import open_gating
from dejavuu_build.cache import read_manifest
from dejavuu_build.runtime.session import make_session
from q41_common import ENTRY as E, session
man = read_manifest(E)
g = open_gating(E, man, 2)
qs_sess = session()
c_static = S.variant_contract(g.contract, man.variants["int8-static"])
c_i4 = S.variant_contract(g.contract, man.variants["int4-static"])
fp32 = Runner(make_session(E / "decoder_fp32.onnx", 2), S.variant_contract(g.contract, man.variants["fp32"]), None)
runners = {
    "q41-op (file's Q4_1, exact)": Runner(qs_sess, c_static, None),
    "int8-static (default)": Runner(make_session(E / "decoder_int8-static.onnx", 2), c_static, None),
    "int4-static (MLAS + offset term)": Runner(make_session(E / "decoder_int4-static.onnx", 2), c_i4, None),
}
qs = scoring_set(E, fp32, g.ref, 8192)
floors = {k: 0.0 for k in runners}
for k, v in gate_quality(fp32, runners, qs, floors).items():
    print(f"{k}: top-1 {v['top1']:.4f}  KL {v['mean_kl']:.5f}  positions {v.get('positions')}")
