"""The target's token embedding and output head, dequantized from its GGUF.

A DFlash drafter has no embedding table or LM head of its own: it uses the target's. For training
they are read from the target GGUF with the PyPI ``gguf`` package (``GGUFReader`` memory-maps the
file; ``gguf.quants.dequantize`` decodes F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, the K-quants
Q2_K..Q6_K and the IQ types into float32). ``output.weight`` is used when present, else the
embedding (tied embeddings, as SmolLM2).

Example::

    from dflash2_gguf.assets import fetch
    from dflash2_gguf.train.target_weights import load_target_weights
    tw = load_target_weights(fetch("smollm2-135m-instruct-q4_1"))
    tw.embed.shape, tw.head is None, tw.info.n_layers     # (49152, 576), True, 30
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TargetInfo", "TargetWeights", "dequantize_tensor", "load_target_weights", "read_target_info"]


@dataclass(frozen=True)
class TargetInfo:
    """What the drafter must agree with: architecture, depth, width, vocabulary."""

    arch: str
    n_layers: int
    hidden_size: int
    vocab_size: int
    context_length: int | None
    n_head: int | None = None
    n_head_kv: int | None = None
    n_ff: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    mask_token_id: int | None = None   # tokenizer.ggml.mask_token_id, else unknown_token_id

    def default_mask_token_id(self) -> int:
        """A token to use as the drafter's MASK: the GGUF's mask token, else its unknown token,
        else the last id of the vocabulary."""
        return self.mask_token_id if self.mask_token_id is not None else self.vocab_size - 1


@dataclass
class TargetWeights:
    """embed [V, H] float32; head [V, H] float32, or None when tied to the embedding."""

    embed: np.ndarray
    head: np.ndarray | None
    info: TargetInfo

    def torch(self, dtype=None):
        """(embed, head) as torch tensors (head is None when tied)."""
        import torch

        dtype = dtype or torch.float32
        e = torch.from_numpy(self.embed).to(dtype)
        return e, (None if self.head is None else torch.from_numpy(self.head).to(dtype))


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()


def read_target_info(reader) -> TargetInfo:
    """Architecture, block count, embedding length, vocab size from a ``GGUFReader``."""
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise ValueError("not a model GGUF: no general.architecture")
    n_layers = _field(reader, f"{arch}.block_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if n_layers is None or hidden is None or vocab is None:
        raise ValueError(f"GGUF lacks {arch}.block_count / embedding_length / vocab size")
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_head = n_head[0] if isinstance(n_head, list) else n_head   # per-layer arrays: first layer
    n_kv = _field(reader, f"{arch}.attention.head_count_kv")
    n_kv = n_kv[0] if isinstance(n_kv, list) else n_kv
    n_ff = _field(reader, f"{arch}.feed_forward_length")
    n_ff = n_ff[0] if isinstance(n_ff, list) else n_ff
    head_dim = _field(reader, f"{arch}.attention.key_length") or (
        int(hidden) // int(n_head) if n_head else None)
    mask = _field(reader, "tokenizer.ggml.mask_token_id")
    if mask is None:
        mask = _field(reader, "tokenizer.ggml.unknown_token_id")
    eps = _field(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    theta = _field(reader, f"{arch}.rope.freq_base")
    return TargetInfo(arch=str(arch), n_layers=int(n_layers), hidden_size=int(hidden),
                      vocab_size=int(vocab), context_length=_field(reader, f"{arch}.context_length"),
                      n_head=None if n_head is None else int(n_head),
                      n_head_kv=None if n_kv is None else int(n_kv),
                      n_ff=None if n_ff is None else int(n_ff),
                      head_dim=None if head_dim is None else int(head_dim),
                      rope_theta=None if theta is None else float(f"{float(theta):.7g}"),
                      rms_norm_eps=None if eps is None else float(f"{float(eps):.7g}"),
                      mask_token_id=None if mask is None else int(mask))


def dequantize_tensor(tensor) -> np.ndarray:
    """One ``ReaderTensor`` -> float32 array in numpy order (GGUF ne reversed: [rows, cols])."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    data = np.asarray(tensor.data)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        out = data.astype(np.float32)
    else:
        try:
            out = dequantize(data, qtype)
        except NotImplementedError as e:  # pragma: no cover - depends on the gguf release
            raise NotImplementedError(f"gguf cannot dequantize {tensor.name} ({qtype.name})") from e
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)


def load_target_weights(path) -> TargetWeights:
    """Dequantize ``token_embd.weight`` and ``output.weight`` (if any) of the target GGUF at
    ``path`` (a path, or an open ``gguf.GGUFReader``: parsing a large vocabulary takes
    seconds). Shapes are checked against the GGUF's embedding length and vocab size."""
    from gguf import GGUFReader

    reader = path if isinstance(path, GGUFReader) else GGUFReader(str(path))
    info = read_target_info(reader)
    by_name = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in by_name:
        raise ValueError(f"{path}: no token_embd.weight")
    embed = dequantize_tensor(by_name["token_embd.weight"])
    head = dequantize_tensor(by_name["output.weight"]) if "output.weight" in by_name else None
    for name, arr in (("token_embd.weight", embed), ("output.weight", head)):
        if arr is not None and arr.shape != (info.vocab_size, info.hidden_size):
            raise ValueError(f"{path}: {name} has shape {arr.shape}, expected "
                             f"{(info.vocab_size, info.hidden_size)}")
    return TargetWeights(embed=embed, head=head, info=info)
