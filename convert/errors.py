"""The converter's one exception type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ConversionError", "read_json"]


class ConversionError(ValueError):
    """Bad input to the converter (checkpoint, config, target, output path, options).

    Raised before anything is written whenever possible; when raised later, the partial output
    has already been removed. The CLI prints the message and exits with status 2.
    """


def read_json(path: str | Path) -> Any:
    """The parsed contents of a JSON file (UTF-8).

    Raises:
        ConversionError: the file cannot be read or is not valid JSON (message names the file).
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None
