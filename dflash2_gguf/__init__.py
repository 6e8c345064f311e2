"""dflash2-gguf: DFlash / DFlash 2 speculative decoding for llama.cpp and GGUF.

Public names are resolved lazily (module ``__getattr__``): ``import dflash2_gguf`` never loads
the native extension or llama-cpp-python, so the converter and training work on machines where
the extension is not built. The extension loads when a :class:`DFlashDecoder` is created.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> submodule that defines it
_LAZY = {
    "DFlashDecoder": "decoder.api",
    "GenerationResult": "decoder.api",
    "GenerationStats": "decoder.api",
    "StreamChunk": "decoder.api",
    "SamplingParams": "decoder.sampling",
    "DFlashError": "errors",
    "IncompatibleDrafterError": "errors",
    "UnsupportedError": "errors",
    "ModelLoadError": "errors",
    "DecodeError": "errors",
    "ContextFullError": "errors",
    "ClosedError": "errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dflash2_gguf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))
