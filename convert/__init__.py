"""DFlash / DFlash 2 drafter converter: authors' HF checkpoint -> llama.cpp ``dflash`` GGUF.

Public API (flags of ``python -m convert`` map 1:1 onto these)::

    from convert import convert_hf_to_gguf, inspect_gguf, ConversionError
    out = convert_hf_to_gguf("org/Some-DFlash2", outtype="q4_k_m")   # target: the one the drafter names
    out = convert_hf_to_gguf("path/or/hub-id", target="target.gguf", outtype="q8_0")
    # target may also be an HF folder, a hub id "org/name" or a hub GGUF "org/name-GGUF:Q4_K_M"
    info = inspect_gguf(out, target="target.gguf")   # {"version": "v2", "fits": True, ...}
"""

from __future__ import annotations

from .errors import ConversionError
from .hf_to_gguf import convert_hf_to_gguf
from .inspect import inspect_gguf

__all__ = ["ConversionError", "convert_hf_to_gguf", "inspect_gguf"]
