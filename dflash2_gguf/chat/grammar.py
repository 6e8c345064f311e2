"""Grammars for constrained output: JSON schemas turned into GBNF, and the generic JSON grammar.

Both come from llama-cpp-python 0.3.36's ``llama_cpp.llama_grammar`` (its ``SchemaConverter`` is
the Python port of llama.cpp's ``json_schema_to_grammar``; ``JSON_GBNF`` is llama.cpp's
``grammars/json.gbnf``), so the grammars are the ones llama.cpp users get for the same schema.
The driver enforces them with libllama's grammar sampler (``native/sampling.cpp``).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence, Union

__all__ = ["json_schema_to_grammar", "json_grammar", "grammar_for_response_format"]


def json_schema_to_grammar(schema: Union[str, Mapping[str, Any]], prop_order: Optional[Sequence[str]] = None) -> str:
    """GBNF (root rule ``root``) that accepts exactly the JSON documents valid under ``schema``.

    Args:
        schema: A JSON schema, as a dict or a JSON string.
        prop_order: Property names to emit first, in this order (llama.cpp's ``--json-schema``
            converter option); the others follow in schema order.

    Raises:
        ValueError: the schema is not JSON, or uses something the converter does not support
            (the message names it; remote ``$ref`` URLs are never fetched).
    """
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return json_schema_to_gbnf(text, list(prop_order or []))
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    except Exception as e:  # the converter raises plain Exceptions / KeyErrors on unsupported input
        raise ValueError(f"cannot turn this JSON schema into a grammar: {type(e).__name__}: {e}") from e


def json_grammar() -> str:
    """GBNF of any JSON value (llama.cpp's ``grammars/json.gbnf``): OpenAI's ``json_object``."""
    from llama_cpp.llama_grammar import JSON_GBNF

    return JSON_GBNF


def grammar_for_response_format(response_format: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The grammar an OpenAI ``response_format`` asks for, or None for ``text`` / absent.

    ``{"type": "json_object"}`` (optionally with llama-server's ``"schema"``) and
    ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}`` (OpenAI's structured
    outputs, what ``client.beta.chat.completions.parse`` sends).

    Raises:
        ValueError: an unknown type, or a ``json_schema`` without a schema.
    """
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return json_schema_to_grammar(schema) if schema else json_grammar()
    if kind == "json_schema":
        js = response_format.get("json_schema") or {}
        schema = js.get("schema") if isinstance(js, Mapping) else None
        if schema is None:
            schema = response_format.get("schema")
        if schema is None:
            raise ValueError("response_format.json_schema.schema is missing")
        return json_schema_to_grammar(schema)
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
