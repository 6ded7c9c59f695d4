"""`dejavuu-build bench`: Spec-Bench speedups per category, gated on exact agreement with plain decoding.

from dejavuu_build.bench import BenchConfig, run_bench
report = run_bench(BenchConfig(model="smollm2-135m", methods=("baseline", "pld")), out_dir)
"""

from .config import BenchConfig, BenchError
from .runner import ExactnessError, run_bench

__all__ = ["BenchConfig", "BenchError", "ExactnessError", "run_bench"]
