"""What the Q4_1 spike scripts share (docs/speed.md, twenty-second session): where the entry, the
operator library and the rewritten graph are, and one onnxruntime session of that graph with the
runtime's own options (runtime.session.make_session) plus the operator. Measurement code."""
import os
from pathlib import Path

import onnxruntime as ort

from dejavuu_build.runtime import load
from dejavuu_build.runtime.decoder import Decoder

ENTRY = Path(os.environ.get("Q41_ENTRY", Path.home() / ".cache/dejavuu/smollm2-s22b"))
LIB = os.environ.get("Q41_LIB", "libq41op.so")  # g++ ... -o libq41op.so q41_op.cpp (its header says how)
GRAPH = os.environ.get("Q41_GRAPH", "q41.onnx")  # written by q41_graph.py
THREADS = 2


def session(graph: str = GRAPH, threads: int = THREADS) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.register_custom_ops_library(str(Path(LIB).resolve()))
    return ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])


def q41_model(threads: int = THREADS):
    """The entry's default model with its decoder running the Q41MatMul graph instead."""
    m = load(str(ENTRY), threads=threads)
    m.decoder = Decoder(session(threads=threads), m.contract, m.decoder.embed)
    return m
