"""GGUF ``tokenizer.*`` keys from an HF target folder, the way llama.cpp's converter writes them.

Upstream's ``DFlashModel.set_vocab`` (``conversion/qwen.py``, llama.cpp 0c1e570) points its
``dir_model`` at ``--target-model-dir``, looks the target's class up by its config.json
``architectures`` and runs *that class's* ``set_vocab``. This module does the same for the target
families a drafter is trained for, from one table (:data:`VOCAB_HANDLERS`: HF architecture ->
upstream vocab handler), each handler a copy of upstream's:

- ``gpt2``: ``_set_vocab_gpt2`` (byte-level BPE ``tokenizer.json``; :mod:`convert.hf_tokenizer`);
- ``sentencepiece``: ``_set_vocab_sentencepiece`` / ``_create_vocab_sentencepiece``
  (``tokenizer.model`` read with the ``sentencepiece`` package: pieces, scores, token types,
  ``added_tokens.json``, ``tokenizer_config.json`` ``added_tokens_decoder``; then gguf-py's
  ``SpecialVocab``: special ids, ``add_bos/add_eos``, chat template);
- ``spm_or_gpt2``: ``Qwen2Model.set_vocab`` (``tokenizer.model`` if there is one, else gpt2);
- ``llama``: ``LlamaModel.set_vocab`` (``add_prefix_space``; sentencepiece, else a SentencePiece-
  converted ``tokenizer.json`` through gguf-py's ``LlamaHfVocab``, else gpt2; CodeLlama's infill
  ids at vocab 32016, Granite's ``add_bos_token = false`` at 49152);
- ``gemma`` / ``gemma2`` / ``gemma3`` / ``gemma4``: ``GemmaModel`` .. ``Gemma4Model.set_vocab``.

Refused, with the fix (pass the target's GGUF): tiktoken-style tokenizers (``QWenLMHeadModel``'s
``_set_vocab_qwen`` and the like read them through the model's own remote code,
``trust_remote_code``), Mistral's ``tekken.json`` format, and architectures whose upstream handler
is not copied here. An architecture missing from the table gets upstream's default,
``TextModel.set_vocab`` = gpt2.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from .errors import ConversionError, read_json
from .gguf_meta import KV
from .hf_tokenizer import add_gpt2_vocab, looks_special, new_writer, writer_fields

__all__ = ["target_vocab_fields", "VOCAB_HANDLERS", "REFUSED", "add_sentencepiece_vocab"]

logger = logging.getLogger(__name__)

_FIX = "pass the target's GGUF as --target instead (its tokenizer is copied as is)"

#: HF ``architectures[0]`` -> upstream vocab handler (see module docstring). Registered names as
#: in ``@ModelBase.register(...)`` of llama.cpp 0c1e570's ``conversion/*.py``.
VOCAB_HANDLERS: dict[str, str] = {
    # conversion/qwen.py Qwen2Model (and Qwen3Model, Qwen3VL's text model, which inherit it)
    **dict.fromkeys(("Qwen2Model", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3Model",
                     "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                     "Qwen3VLForConditionalGeneration", "DeepseekForCausalLM", "GrokForCausalLM"),
                    "spm_or_gpt2"),
    # TextModel.set_vocab / an explicit _set_vocab_gpt2
    **dict.fromkeys(("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
                     "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM",
                     "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                     "Qwen3VLMoeForConditionalGeneration", "GptOssForCausalLM",
                     "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4ForCausalLM",
                     "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM", "Starcoder2ForCausalLM",
                     "GPTBigCodeForCausalLM", "Exaone4ForCausalLM", "SeedOssForCausalLM",
                     "MiniMaxM2ForCausalLM", "MuseGlimmerForConditionalGeneration"), "gpt2"),
    # conversion/llama.py LlamaModel and its subclasses
    **dict.fromkeys(("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "LlamaModel",
                     "GraniteForCausalLM", "GraniteMoeForCausalLM", "SmolLM3ForCausalLM",
                     "ArceeForCausalLM", "ApertusForCausalLM", "NanbeigeForCausalLM"), "llama"),
    # conversion/gemma.py
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    # sentencepiece only
    **dict.fromkeys(("BaichuanForCausalLM", "InternLM2ForCausalLM", "MiniCPMForCausalLM",
                     "OrionForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM"), "sentencepiece"),
}

#: HF architectures whose upstream handler reads the tokenizer in a way not copied here -> why.
REFUSED: dict[str, str] = {
    "QWenLMHeadModel": "a tiktoken tokenizer, which llama.cpp's converter reads through the model's own "
                       "remote code (trust_remote_code)",
    "KimiLinearForCausalLM": "a tiktoken tokenizer read through the model's own remote code",
    "ChatGLMModel": "a tiktoken / SentencePiece tokenizer read through the model's own remote code",
    "ChatGLMForConditionalGeneration": "a tokenizer read through the model's own remote code",
    "Mistral3ForConditionalGeneration": "Mistral's own tokenizer format (mistral-common)",
    "Ministral3ForCausalLM": "Mistral's own tokenizer format (mistral-common)",
    "Phi3ForCausalLM": "a SentencePiece vocab with Phi-3's own token handling",
    "Plamo2ForCausalLM": "PLaMo 2's own vocab format",
    "Rwkv6ForCausalLM": "the RWKV world vocab",
    "Rwkv7ForCausalLM": "the RWKV world vocab",
}


class _NoFile(ConversionError):
    """The handler's tokenizer file is absent (upstream: FileNotFoundError, next handler tried)."""


def add_sentencepiece_vocab(w, folder: Path, n_vocab: int) -> None:
    """Upstream ``_set_vocab_sentencepiece``: ``tokenizer.model`` -> model "llama", pre "default",
    tokens (bytes), scores (float32), token types, then gguf-py ``SpecialVocab`` (no merges).

    Token types follow ``_create_vocab_sentencepiece``: NORMAL, UNKNOWN, CONTROL, UNUSED, BYTE
    from the SentencePiece model; ``added_tokens.json`` entries USER_DEFINED (score -1000);
    ``tokenizer_config.json`` ``added_tokens_decoder`` entries CONTROL when special or
    :func:`~convert.hf_tokenizer.looks_special`, else USER_DEFINED with ``▁`` -> space (score
    -1000); ids the model lacks up to ``n_vocab`` are ``[PAD{id}]``, UNUSED, score -10000.

    Raises:
        ConversionError: no ``tokenizer.model`` (a ``_NoFile``), no ``sentencepiece`` package, an
            unreadable model.
    """
    import gguf

    path = folder / "tokenizer.model"
    if not path.is_file():
        raise _NoFile(f"HF target folder {folder} has no tokenizer.model; {_FIX}")
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError:
        raise ConversionError(f"{path}: a SentencePiece target needs the sentencepiece package "
                              f"(pip install sentencepiece), or {_FIX}") from None
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise ConversionError(f"{path}: not a SentencePiece model ({e}); {_FIX}") from None

    T = gguf.TokenType
    tokens: list[bytes] = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores: list[float] = [-10000.0] * n_vocab
    types: list[int] = [T.UNUSED] * n_vocab
    for i in range(sp.vocab_size()):
        if i >= n_vocab:
            logger.warning("%s: ignoring pieces from id %d on: the vocab size is %d", path, i, n_vocab)
            break
        t = T.NORMAL
        if sp.IsUnknown(i):
            t = T.UNKNOWN
        elif sp.IsControl(i):
            t = T.CONTROL
        elif sp.IsUnused(i):
            t = T.UNUSED
        elif sp.IsByte(i):
            t = T.BYTE
        tokens[i], scores[i], types[i] = sp.IdToPiece(i).encode("utf-8"), sp.GetScore(i), t

    added_file = folder / "added_tokens.json"
    if added_file.is_file():
        for text, i in read_json(added_file).items():
            if i >= n_vocab:
                logger.warning("%s: ignoring token %d: the vocab size is %d", added_file, i, n_vocab)
                continue
            tokens[i], scores[i], types[i] = text.encode("utf-8"), -1000.0, T.USER_DEFINED

    tcfg_file = folder / "tokenizer_config.json"
    if tcfg_file.is_file():
        decoder = (read_json(tcfg_file) or {}).get("added_tokens_decoder", {})
        for key, data in decoder.items():
            i, text = int(key), data["content"]
            if i >= n_vocab:
                logger.warning("%s: ignoring token %d: the vocab size is %d", tcfg_file, i, n_vocab)
                continue
            if data.get("special") or looks_special(text):
                types[i] = T.CONTROL
            else:
                text = text.replace("\u2581", " ")  # pre-normalize user-defined spaces
                types[i] = T.USER_DEFINED
            tokens[i], scores[i] = text.encode("utf-8"), -1000.0

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _llama_hf_tokens(folder: Path):
    """gguf-py ``LlamaHfVocab`` (a SentencePiece-converted ``tokenizer.json``; needs transformers).

    Raises ``_NoFile`` where upstream's handler raises FileNotFoundError / TypeError (no such
    tokenizer.json, or a Llama 3 byte-level one), ConversionError without transformers.
    """
    import gguf

    try:
        return gguf.LlamaHfVocab(folder)
    except (FileNotFoundError, TypeError) as e:
        raise _NoFile(str(e)) from None
    except ImportError:
        raise ConversionError(f"{folder / 'tokenizer.json'}: a SentencePiece-style tokenizer.json needs "
                              f"the transformers package (pip install transformers), or {_FIX}") from None


def _add_llama_hf_vocab(w, folder: Path, n_vocab: int) -> None:
    """Upstream ``_set_vocab_llama_hf``."""
    import gguf

    vocab = _llama_hf_tokens(folder)
    tokens, scores, types = zip(*vocab.all_tokens())
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(tokens))
    w.add_token_scores(list(scores))
    w.add_token_types(list(types))
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _infill_ids(w, folder: Path, ids: dict[str, int], *, no_template: bool = False) -> None:
    """A second ``SpecialVocab`` with fixed infill ids (CodeLlama, CodeGemma), as upstream adds it."""
    import gguf

    sv = gguf.SpecialVocab(folder, load_merges=False, special_token_types=list(ids))
    for name, i in ids.items():
        sv._set_special_token(name, i)  # upstream sets them the same way
    if no_template:
        sv.chat_template = None
    sv.add_to_gguf(w, quiet=True)


def _llama(w, folder: Path, n_vocab: int) -> None:
    """Upstream ``LlamaModel.set_vocab`` (conversion/llama.py) for a target folder."""
    if (folder / "tekken.json").is_file() and not (folder / "tokenizer.json").is_file():
        raise ConversionError(f"{folder}: Mistral's tekken.json tokenizer is not converted here; {_FIX}")
    tcfg_file = folder / "tokenizer_config.json"
    if tcfg_file.is_file():
        tcfg = read_json(tcfg_file) or {}
        if (aps := tcfg.get("add_prefix_space")) is not None:
            w.add_add_space_prefix(aps)
        if tcfg.get("tokenizer_class") == "HybridDNATokenizer":
            raise ConversionError(f"{folder}: a HybridDNA tokenizer is not converted here; {_FIX}")
    try:
        add_sentencepiece_vocab(w, folder, n_vocab)
    except _NoFile:
        try:
            _add_llama_hf_vocab(w, folder, n_vocab)
        except _NoFile:
            add_gpt2_vocab(w, folder, n_vocab)  # Llama 3
    if n_vocab == 32016:  # CodeLlama
        _infill_ids(w, folder, {"prefix": 32007, "suffix": 32008, "middle": 32009, "eot": 32010})
    if n_vocab == 49152:  # Granite small models
        w.add_add_bos_token(False)


def _spm_or_gpt2(w, folder: Path, n_vocab: int) -> None:
    """Upstream ``Qwen2Model.set_vocab``: sentencepiece if ``tokenizer.model``, else gpt2."""
    try:
        add_sentencepiece_vocab(w, folder, n_vocab)
    except _NoFile:
        add_gpt2_vocab(w, folder, n_vocab)


def _gemma(w, folder: Path, n_vocab: int) -> None:
    """Upstream ``GemmaModel.set_vocab``: sentencepiece + CodeGemma's infill ids."""
    add_sentencepiece_vocab(w, folder, n_vocab)
    _infill_ids(w, folder, {"prefix": 67, "suffix": 69, "middle": 68, "fsep": 70, "eot": 107},
                no_template=True)
    w.add_add_space_prefix(False)


def _gemma2(w, folder: Path, n_vocab: int) -> None:
    add_sentencepiece_vocab(w, folder, n_vocab)
    w.add_add_space_prefix(False)


def _gemma3(w, folder: Path, n_vocab: int) -> None:
    if (folder / "tokenizer.model").is_file():
        add_sentencepiece_vocab(w, folder, n_vocab)
        w.add_add_space_prefix(False)
    else:
        add_gpt2_vocab(w, folder, n_vocab)


_GEMMA4_VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                   "<tool_response|>", '<|"|>'}


def _gemma4(w, folder: Path, n_vocab: int) -> None:
    """Upstream ``Gemma4Model.set_vocab``: ``LlamaHfVocab``, tokenizer model "gemma4"."""
    import gguf

    try:
        vocab = _llama_hf_tokens(folder)
    except _NoFile as e:
        raise ConversionError(f"{folder}: Gemma 4 needs its SentencePiece-style tokenizer.json ({e}); {_FIX}") from None
    tokens, scores, types = [], [], []
    for text, score, t in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(gguf.TokenType.USER_DEFINED if text.decode() in _GEMMA4_VISIBLE else t)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(w, quiet=True)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)


_HANDLERS: dict[str, Callable[..., None]] = {
    "gpt2": add_gpt2_vocab, "sentencepiece": add_sentencepiece_vocab, "spm_or_gpt2": _spm_or_gpt2,
    "llama": _llama, "gemma": _gemma, "gemma2": _gemma2, "gemma3": _gemma3, "gemma4": _gemma4,
}


def target_vocab_fields(folder: str | Path, n_vocab: int, arch: str | None) -> list[KV]:
    """Every ``tokenizer.*`` key (but the mask token id) for an HF target folder.

    Args:
        folder: the target's HF folder (``config.json`` + its tokenizer files).
        n_vocab: the vocab size (config.json ``vocab_size``; the drafter's must equal it): the
            token list is padded with ``[PAD{id}]`` to it, as upstream pads to the drafter's.
        arch: config.json ``architectures[0]`` (None: upstream's default handler, gpt2).

    Returns:
        :class:`KV` list in the order upstream's handler adds them, with its value types.

    Raises:
        ConversionError: a refused architecture (:data:`REFUSED`), missing / unreadable tokenizer
            files, a byte-level BPE tokenizer with an unknown pre-tokenizer; every message ends
            with the fix (pass the target's GGUF).
    """
    folder = Path(folder)
    if arch in REFUSED:
        raise ConversionError(f"target {folder} ({arch}) has {REFUSED[arch]}; {_FIX}")
    name = VOCAB_HANDLERS.get(arch or "", "gpt2")
    if arch and arch not in VOCAB_HANDLERS:
        logger.info("target architecture %s is not in the vocab table: using upstream's default "
                    "(byte-level BPE from tokenizer.json)", arch)
    w = new_writer()
    try:
        _HANDLERS[name](w, folder, n_vocab)
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"{folder}: malformed tokenizer files ({type(e).__name__}: {e}); {_FIX}") from None
    return writer_fields(w)
