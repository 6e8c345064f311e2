"""The converter's one exception type."""

from __future__ import annotations

__all__ = ["ConversionError"]


class ConversionError(ValueError):
    """Bad input to the converter (checkpoint, config, target, output path, options).

    Raised before anything is written whenever possible; when raised later, the partial output
    has already been removed. The CLI prints the message and exits with status 2.
    """
