"""Load the compiled extension after llama-cpp-python's libllama, so one copy is mapped."""

from __future__ import annotations

import importlib
from types import ModuleType

_native: ModuleType | None = None


def native() -> ModuleType:
    """Return the ``dflash2_gguf._native`` extension module, checked against the pinned libllama.

    Raises:
        ImportError: the extension is not built, or the loaded libllama is not the build
            (llama.cpp 0c1e570, llama-cpp-python 0.3.36) that the extension was compiled for.
    """
    global _native
    if _native is None:
        # Importing llama_cpp first maps site-packages/llama_cpp/lib/libllama.so; the extension's
        # DT_NEEDED libllama.so.0 then resolves to that same copy.
        import llama_cpp  # noqa: F401

        try:
            mod = importlib.import_module("dflash2_gguf._native")
        except ImportError as e:
            raise ImportError(
                "the dflash2_gguf native extension is not built: install the package with "
                "`pip install --no-build-isolation -e .` after `pip install llama-cpp-python==0.3.36` "
                f"({e})"
            ) from e
        problem = mod.check_libllama()
        if problem:
            raise ImportError(problem)
        from .errors import from_native

        mod._set_error_factory(from_native)
        _native = mod
    return _native
