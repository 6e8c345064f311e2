"""dflash2-gguf: DFlash / DFlash 2 speculative decoding for llama.cpp and GGUF.

The native extension is imported lazily (module ``__getattr__``), so the converter and training
work on machines where it is not built.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
