"""Weight-only block quantization (MatMulNBits / GatherBlockQuantized) with per-node overrides."""

from .nbits import PLANS, QuantPlan, quantize_model

__all__ = ["QuantPlan", "quantize_model", "PLANS"]
