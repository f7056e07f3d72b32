"""urpe.hf's one dependency beyond torch, checked once with an error that says what to install."""

try:
    import transformers
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("urpe.hf needs transformers: pip install 'urpe[hf]'") from error

TRANSFORMERS_VERSION = transformers.__version__
