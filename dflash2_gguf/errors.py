"""Exceptions raised by the dflash2_gguf runtime (decoder, CLI).

Every error coming from the native driver is a :class:`DFlashError` carrying ``code`` (one of the
``CODE_*`` constants, mirroring ``dflash2::ErrorCode`` in ``native/driver.h``) and ``rc`` (the
libllama return code when one exists, else 0). Subclasses let callers catch a category; the
pairing errors also derive from :class:`ValueError`. Invalid arguments raise plain
:class:`ValueError`.
"""

from __future__ import annotations

__all__ = [
    "DFlashError", "ModelLoadError", "IncompatibleDrafterError", "UnsupportedError",
    "DecodeError", "ContextFullError", "ClosedError",
    "CODE_LOAD", "CODE_INCOMPATIBLE", "CODE_UNSUPPORTED", "CODE_DECODE", "CODE_CONTEXT_FULL",
    "CODE_CLOSED", "CODE_INTERNAL", "from_native",
]

CODE_LOAD = 1
CODE_INCOMPATIBLE = 2
CODE_UNSUPPORTED = 3
CODE_DECODE = 4
CODE_CONTEXT_FULL = 5
CODE_CLOSED = 6
CODE_INTERNAL = 7


class DFlashError(RuntimeError):
    """A driver error. ``code``: error category; ``rc``: libllama return code (0 if none)."""

    def __init__(self, message: str, code: int = CODE_INTERNAL, rc: int = 0):
        super().__init__(message)
        self.code = code
        self.rc = rc

    def __str__(self) -> str:  # keep the message readable, the code is an attribute
        return f"{self.args[0]} [code {self.code}" + (f", rc {self.rc}]" if self.rc else "]")


class ModelLoadError(DFlashError):
    """A GGUF could not be read, loaded, or given a context."""


class IncompatibleDrafterError(DFlashError, ValueError):
    """The drafter does not fit the target (vocab, hidden size, target layer ids, v2 width)."""


class UnsupportedError(DFlashError):
    """A configuration the driver refuses (e.g. a context shift on a target with a recurrent state)."""


class DecodeError(DFlashError):
    """llama_decode / llama_process returned non-zero (``rc``)."""


class ContextFullError(DFlashError):
    """The prompt (plus generation) does not fit the context."""


class ClosedError(DFlashError):
    """The decoder was closed."""


_BY_CODE = {
    CODE_LOAD: ModelLoadError,
    CODE_INCOMPATIBLE: IncompatibleDrafterError,
    CODE_UNSUPPORTED: UnsupportedError,
    CODE_DECODE: DecodeError,
    CODE_CONTEXT_FULL: ContextFullError,
    CODE_CLOSED: ClosedError,
}


def from_native(message: str, code: int, rc: int) -> DFlashError:
    """Build the exception for a native driver error (registered with the extension)."""
    return _BY_CODE.get(code, DFlashError)(message, code, rc)
