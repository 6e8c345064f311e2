"""Load the compiled extension after llama-cpp-python's libllama, so one copy is mapped."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

_native: ModuleType | None = None
#: Windows: the handle of llama_cpp/lib added to the DLL search path (kept open for the process).
_dll_dir = None


def _add_llama_dll_directory(llama_cpp_module: ModuleType) -> None:
    """Windows has no rpath: let the extension's ``llama.dll`` / ``ggml*.dll`` resolve to
    llama-cpp-python's ``llama_cpp/lib`` (the copies ``import llama_cpp`` loaded). Elsewhere the
    extension's rpath (``$ORIGIN`` / ``@loader_path``, CMakeLists.txt) points there already."""
    global _dll_dir
    if sys.platform != "win32" or _dll_dir is not None:
        return
    lib = Path(llama_cpp_module.__file__).resolve().parent / "lib"
    if lib.is_dir():
        _dll_dir = os.add_dll_directory(str(lib))


def native() -> ModuleType:
    """Return the ``dflash2_gguf._native`` extension module, checked against the pinned libllama.

    Raises:
        ImportError: the extension is not built, or the loaded libllama is not the build
            (llama.cpp 0c1e570, llama-cpp-python 0.3.36) that the extension was compiled for.
    """
    global _native
    if _native is None:
        # Importing llama_cpp first maps site-packages/llama_cpp/lib/libllama.so; the extension's
        # DT_NEEDED libllama.so.0 then resolves to that same copy (macOS: @rpath/libllama.0.dylib
        # through @loader_path; Windows: llama.dll through the DLL directory added here).
        import llama_cpp

        _add_llama_dll_directory(llama_cpp)

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
