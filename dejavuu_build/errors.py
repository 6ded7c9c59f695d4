"""Typed errors. Each carries a one-line message that says what to do; the CLI prints it alone."""


class DejavuuError(Exception):
    """Base of every error the CLI turns into a one-line message and a non-zero exit."""


class ModelSourceError(DejavuuError):
    """The model could not be found or fetched (bad path, hub offline, PyPI dist without a .gguf)."""


class UnsupportedArchitecture(DejavuuError):
    """No recipe is registered for the model's architecture."""


class ExportError(DejavuuError):
    """torch.onnx export or the post-export graph surgery failed."""


class ValidationFailed(DejavuuError):
    """An fp32 export failed its parity gate (a hard error: the build is not written)."""


class CacheError(DejavuuError):
    """The cache entry is missing, locked by another build, or corrupted."""


class IntegrityError(CacheError):
    """A file's sha256 no longer matches the manifest."""


class ContractError(DejavuuError):
    """An ONNX graph's inputs/outputs do not match what the runtime or contract.json expects."""


class GenerationError(DejavuuError):
    """Bad generation input (empty prompt, too long, unknown method)."""


class KernelUnavailable(DejavuuError):
    """A native operator could not be built or loaded on this machine (no C++ compiler, or onnxruntime refused it)."""
