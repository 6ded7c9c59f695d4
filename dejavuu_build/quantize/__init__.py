"""Weight-only block quantization (MatMulNBits / GatherBlockQuantized) with per-node overrides."""

from .nbits import QuantPlan, quantize_model, PLANS

__all__ = ["QuantPlan", "quantize_model", "PLANS"]
