"""GGUF ``tokenizer.*`` keys from an HF target folder's ``tokenizer.json`` (byte-level BPE).

A drafter GGUF carries its target's tokenizer. When the target is given as a Hugging Face
folder rather than a GGUF, this module builds the keys llama.cpp's ``gpt2`` (byte-level BPE)
vocab reads, the way upstream's ``convert_hf_to_gguf.py`` writes them (``_set_vocab_gpt2`` /
``get_vocab_base`` in ``conversion/base.py`` of llama-cpp-python 0.3.36's vendored llama.cpp):

- ``tokenizer.ggml.tokens``: one string per id in ``[0, n_vocab)``; ids the tokenizer does not
  define are ``[PAD{id}]``;
- ``tokenizer.ggml.token_type``: added tokens marked special (or shaped ``<|...|>``) are CONTROL,
  other added tokens USER_DEFINED, padding ids UNUSED, the rest NORMAL;
- merges, special token ids, ``add_bos/add_eos`` and the chat template: gguf-py's
  :class:`gguf.SpecialVocab`, the same code upstream uses;
- ``tokenizer.ggml.pre`` (which pre-tokenizer llama.cpp runs before BPE): see
  :func:`pre_tokenizer_name`.

Only byte-level BPE tokenizers (``model.type == "BPE"``, a ``ByteLevel`` decoder, no byte
fallback) are handled; SentencePiece / WordPiece / byte-fallback BPE targets raise
:class:`ConversionError` asking for the target's GGUF, which carries its tokenizer ready-made.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import ConversionError, read_json
from .gguf_meta import KV

__all__ = ["hf_tokenizer_fields", "add_gpt2_vocab", "pre_tokenizer_name", "looks_special",
           "new_writer", "writer_fields", "KNOWN_PRE_TOKENIZERS"]

# The split regexes, as the tokenizers' own tokenizer.json files spell them.
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
              r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# o200k (gpt-oss, GPT-4o): case-aware words, contractions attached, numbers in runs of up to 3
_O200K_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
             r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_BYTES_NO_REGEX = ("byte_level", False, False)

#: Canonical pre-tokenizer steps (see :func:`_steps`) -> the ``tokenizer.ggml.pre`` name whose
#: regex set in llama.cpp's ``llama-vocab.cpp`` splits text the same way. Where several names
#: share one regex set (``smollm`` / ``starcoder`` / ``refact``; ``qwen2`` / ``deepseek-r1-qwen``)
#: the family the steps are best known from is written: llama.cpp tokenizes alike for each.
KNOWN_PRE_TOKENIZERS: dict[tuple, str] = {
    # GPT-2: byte-level with its built-in regex
    (("byte_level", True, False),): "gpt-2",
    # SmolLM / StarCoder: digits one by one, then GPT-2's byte-level regex
    (("digits", True), ("byte_level", True, False)): "smollm",
    # Llama 3: numbers in runs of up to 3
    (("split", _LLAMA3_RE, "Isolated", False), _BYTES_NO_REGEX): "llama-bpe",
    # Qwen2 / Qwen2.5 / Qwen3: single digits
    (("split", _QWEN2_RE, "Isolated", False), _BYTES_NO_REGEX): "qwen2",
    # Qwen3.5: letters with combining marks
    (("split", _QWEN35_RE, "Isolated", False), _BYTES_NO_REGEX): "qwen35",
    # gpt-oss (o200k)
    (("split", _O200K_RE, "Isolated", False), _BYTES_NO_REGEX): "gpt-4o",
}


def _steps(pre: Any) -> list[tuple]:
    """Flatten a ``tokenizer.json`` ``pre_tokenizer`` into comparable steps.

    ``Sequence`` nests are flattened; ``ByteLevel`` -> ``("byte_level", use_regex,
    add_prefix_space)``; ``Digits`` -> ``("digits", individual_digits)``; ``Split`` ->
    ``("split", regex, behavior, invert)``; anything else -> ``(type,)`` (never in the table).
    """
    if pre is None:
        return []
    kind = pre.get("type")
    if kind == "Sequence":
        return [s for p in pre.get("pretokenizers", []) for s in _steps(p)]
    if kind == "ByteLevel":
        return [("byte_level", bool(pre.get("use_regex", True)), bool(pre.get("add_prefix_space", False)))]
    if kind == "Digits":
        return [("digits", bool(pre.get("individual_digits", False)))]
    if kind == "Split":
        pattern = pre.get("pattern") or {}
        regex = pattern.get("Regex")
        if regex is None:
            regex = re.escape(pattern.get("String", ""))
        return [("split", regex, pre.get("behavior"), bool(pre.get("invert", False)))]
    return [(str(kind),)]


def pre_tokenizer_name(tokenizer_json: dict, *, where: str = "tokenizer.json") -> str:
    """The ``tokenizer.ggml.pre`` name for a byte-level BPE ``tokenizer.json``.

    Upstream's converter fingerprints a tokenizer by hashing its token ids for a probe text and
    looks the hash up in a table of released models. Here the choice comes from what decides
    llama.cpp's pre-tokenization: the ``pre_tokenizer`` steps (split regexes, digit splitting,
    byte-level regex), matched against :data:`KNOWN_PRE_TOKENIZERS`.

    Raises:
        ConversionError: steps that match no known llama.cpp pre-tokenizer (the message lists
            the steps found and says to pass the target GGUF instead).
    """
    steps = tuple(_steps(tokenizer_json.get("pre_tokenizer")))
    name = KNOWN_PRE_TOKENIZERS.get(steps)
    if name is None:
        raise ConversionError(
            f"{where}: pre-tokenizer {list(steps)} matches none of the llama.cpp pre-tokenizers "
            f"this converter recognises ({', '.join(sorted(set(KNOWN_PRE_TOKENIZERS.values())))}); "
            "pass the target's GGUF as --target instead (its tokenizer is copied as is)")
    return name


def looks_special(token: str) -> bool:
    """Upstream ``TextModel.does_token_look_special``: an added token that acts as a control mark
    even where its tokenizer does not flag it special (``<|...|>``, ``<｜...｜>``, Gemma's
    ``<unused...>``, ``<pad>``, ``<mask>``, ``<2mass>``, ``[@BOS@]``)."""
    return ((token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">"))
            or token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]"))


def hf_tokenizer_fields(folder: str | Path, n_vocab: int) -> list[KV]:
    """Every ``tokenizer.*`` key (except the mask token id) for a byte-level BPE HF target folder.

    Args:
        folder: the target's HF folder (``tokenizer.json``, optionally ``tokenizer_config.json``
            with the chat template and ``add_bos_token``; ``chat_template.jinja``).
        n_vocab: the target's vocab size (``config.json`` ``vocab_size``): the token list is
            padded with ``[PAD{id}]`` up to it.

    Returns:
        :class:`KV` list in upstream's order: model, pre, tokens, token_type, merges, special
        ids, add_* flags, chat template; value types as gguf-py's ``GGUFWriter`` writes them.

    Raises:
        ConversionError: no ``tokenizer.json``, a tokenizer that is not byte-level BPE, an
            unknown pre-tokenizer, token ids at or beyond ``n_vocab``, or no merges.
    """
    w = new_writer()
    add_gpt2_vocab(w, folder, n_vocab)
    return writer_fields(w)


def new_writer():
    """An in-memory ``gguf.GGUFWriter`` to collect keys in (read back with :func:`writer_fields`)."""
    import gguf

    return gguf.GGUFWriter(None, "dflash")


def writer_fields(w) -> list[KV]:
    """The ``tokenizer.*`` keys (but the mask token id) added to ``w``, in order, exact types."""
    import gguf

    mask = gguf.Keys.Tokenizer.MASK_ID
    out = []
    for k, v in w.kv_data[0].items():
        if not k.startswith("tokenizer.") or k == mask:
            continue
        sub = v.sub_type
        if v.type == gguf.GGUFValueType.ARRAY and sub is None:  # as GGUFWriter infers it on write
            sub = gguf.GGUFValueType.get_type(v.value[0])
        out.append(KV(k, v.value, v.type, sub))
    return out


def add_gpt2_vocab(w, folder: str | Path, n_vocab: int) -> None:
    """Add a byte-level BPE ``tokenizer.json``'s keys to the ``gguf.GGUFWriter`` ``w``.

    Upstream ``_set_vocab_gpt2`` (``get_vocab_base`` + ``SpecialVocab(load_merges=True)``).
    Raises ConversionError as :func:`hf_tokenizer_fields` says.
    """
    import gguf

    folder = Path(folder)
    path = folder / "tokenizer.json"
    fix = "pass the target's GGUF as --target instead (its tokenizer is copied as is)"
    if not path.is_file():
        raise ConversionError(f"HF target folder {folder} has no tokenizer.json; {fix}")
    tj = read_json(path)
    if not isinstance(tj, dict) or not isinstance(tj.get("model"), dict):
        raise ConversionError(f"{path}: not a tokenizers-library tokenizer.json (no 'model' object); {fix}")
    model = tj["model"]
    decoder = (tj.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder != "ByteLevel":
        raise ConversionError(
            f"{path}: a {model.get('type')} tokenizer (byte_fallback={bool(model.get('byte_fallback'))}, "
            f"decoder {decoder}) is not the byte-level BPE ('gpt2') kind this converter builds "
            f"from HF files; {fix}")
    pre = pre_tokenizer_name(tj, where=str(path))

    try:
        id_to_token: dict[int, str] = {int(i): t for t, i in model.get("vocab", {}).items()}
        added = {int(a["id"]): a for a in tj.get("added_tokens") or []}
        id_to_token.update((i, a["content"]) for i, a in added.items())
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"{path}: malformed vocab or added_tokens ({type(e).__name__}: {e})") from None
    too_big = sorted(i for i in id_to_token if i >= n_vocab)
    if too_big:
        raise ConversionError(f"{path}: token ids {too_big[:5]} are outside the target vocab size "
                              f"{n_vocab} (config.json vocab_size)")

    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        tok = id_to_token.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            if added[i].get("special") or looks_special(tok):
                types.append(gguf.TokenType.CONTROL)
            else:
                tok = tok.replace("\u2581", " ")  # SentencePiece space mark in a user token
                types.append(gguf.TokenType.USER_DEFINED)
            tokens.append(tok)
        else:
            tokens.append(tok)
            types.append(gguf.TokenType.NORMAL)

    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise ConversionError(f"{path}: no BPE merges found; {fix}")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special.add_to_gguf(w, quiet=True)
