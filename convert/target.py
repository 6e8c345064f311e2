"""The target model a drafter pairs with: its sizes (for checks) and its tokenizer (to copy).

A target GGUF gives everything: ``{arch}.embedding_length``, ``{arch}.block_count``, the vocab
(``tokenizer.ggml.tokens``) and every ``tokenizer.*`` key with its exact GGUF value type.
An HF target folder gives the sizes from ``config.json`` and the tokenizer keys that llama.cpp's
converter writes for its architecture (byte-level BPE ``tokenizer.json``, SentencePiece
``tokenizer.model``, ...), built by :mod:`convert.target_vocab`; the few kinds it does not build
(tiktoken through remote code, Mistral's tekken) need the target GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConversionError, read_json
from .gguf_meta import KV, read_header
from .names import TARGET_LAYER_OFFSET, key

__all__ = ["Target", "KV", "load_target", "read_kv", "check_pairing"]


def read_kv(path: str | Path) -> dict[str, KV]:
    """Every metadata field of a GGUF file as :class:`KV` (exact types), in file order."""
    return read_header(path).kv


@dataclass
class Target:
    """Sizes of the target model and where its tokenizer comes from."""

    path: Path
    kind: str                      # "gguf" or "hf"
    arch: str | None
    n_embd: int
    n_layer: int
    n_vocab: int
    uses_mrope: bool = False
    _tokenizer: list[KV] | None = field(default=None, repr=False)

    def tokenizer_fields(self) -> list[KV]:
        """The target's ``tokenizer.*`` keys (not its mask token id), in file order.

        A target GGUF's keys are copied verbatim (exact value types); an HF folder's are built
        by its architecture's vocab handler (:func:`convert.target_vocab.target_vocab_fields`),
        once.

        Raises:
            ConversionError: an HF folder whose tokenizer kind is not built here, or whose files
                are missing or malformed (the message says to pass the target GGUF instead).
        """
        if self._tokenizer is None:
            from .target_vocab import target_vocab_fields

            self._tokenizer = target_vocab_fields(self.path, self.n_vocab, self.arch)
        return self._tokenizer


def _load_gguf_target(path: Path) -> Target:
    kv = read_kv(path)
    arch_kv = kv.get("general.architecture")
    if arch_kv is None:
        raise ConversionError(f"target GGUF {path} has no general.architecture")
    arch = arch_kv.value.decode("utf-8", "replace")

    def need(name: str) -> int:
        if name not in kv:
            raise ConversionError(f"target GGUF {path} lacks {name!r}")
        return int(kv[name].value)

    tokens = kv.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ConversionError(f"target GGUF {path} has no tokenizer (tokenizer.ggml.tokens)")
    tok = [v for n, v in kv.items() if n.startswith("tokenizer.") and n != key("mask_token_id")]
    return Target(
        path=path, kind="gguf", arch=arch,
        n_embd=need(f"{arch}.embedding_length"), n_layer=need(f"{arch}.block_count"),
        n_vocab=len(tokens.value), uses_mrope=f"{arch}.rope.dimension_sections" in kv,
        _tokenizer=tok,
    )


def _load_hf_target(path: Path) -> Target:
    cfg = read_json(path / "config.json")
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    try:
        n_embd, n_layer, n_vocab = (int(cfg[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(f"target config {path / 'config.json'} lacks {e}") from None
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return Target(path=path, kind="hf", arch=(cfg.get("architectures") or [None])[0],
                  n_embd=n_embd, n_layer=n_layer, n_vocab=n_vocab,
                  uses_mrope="mrope_section" in rope)


def load_target(target: str | Path) -> Target:
    """Open a target given as a ``.gguf`` file or an HF folder with ``config.json``.

    Raises:
        ConversionError: the path does not exist, is not a GGUF / HF folder, or lacks the sizes.
    """
    p = Path(target)
    if p.is_file():
        return _load_gguf_target(p)
    if p.is_dir() and (p / "config.json").is_file():
        return _load_hf_target(p)
    raise ConversionError(f"target {str(target)!r} is neither a GGUF file nor a folder with config.json")


def check_pairing(*, hidden_size: int, vocab_size: int, target_layer_ids, mask_token_id: int,
                  target: Target) -> list[str]:
    """Reasons why a drafter does not fit ``target`` (empty list when it fits).

    Checks: hidden size == target embedding length; vocab size == target vocab; mask token
    inside the target vocab; every HF target layer id + ``TARGET_LAYER_OFFSET`` below the
    target's block count (the layer input llama.cpp stages must exist in the target graph).
    """
    reasons = []
    if hidden_size != target.n_embd:
        reasons.append(f"hidden size {hidden_size} != target embedding length {target.n_embd}")
    if vocab_size != target.n_vocab:
        reasons.append(f"vocab size {vocab_size} != target vocab {target.n_vocab}")
    if not 0 <= mask_token_id < target.n_vocab:
        reasons.append(f"mask token id {mask_token_id} is outside the target vocab [0, {target.n_vocab})")
    bad = [i for i in target_layer_ids if i + TARGET_LAYER_OFFSET >= target.n_layer]
    if bad:
        reasons.append(f"target layer ids {bad} (HF ids) are beyond the target's depth: "
                       f"id + {TARGET_LAYER_OFFSET} must be < target block count {target.n_layer}")
    return reasons
