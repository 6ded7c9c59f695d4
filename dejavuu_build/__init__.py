"""dejavuu-build: tree-capable, hidden-state-emitting ONNX decoders for speculative decoding."""

__version__ = "0.1.0"
