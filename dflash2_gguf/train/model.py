"""The DFlash 2 drafter as one PyTorch module, readable top to bottom.

Written from the method description of the DFlash 2 paper and checked numerically
against the authors' reference ``dflash==0.1.0`` (``dflash/model.py``: ``DFlash2DraftModel``) by
``tests/train/test_train.py``. Attribute names equal the authors' checkpoint keys, so
``DFlash2Drafter.state_dict()`` has exactly the tensor names of their Hugging Face release
(no ``model.`` prefix)::

    fc.weight                                           [H, n_feat * H]
    hidden_norm.weight, norm.weight                     [H]
    layers.N.input_layernorm.weight                     [H]
    layers.N.post_attention_layernorm.weight            [H]
    layers.N.self_attn.{q,k,v,o}_proj.weight            [n_head*hd, H] / [n_kv*hd, H] / [H, n_head*hd]
    layers.N.self_attn.{q,k}_norm.weight                [hd]
    layers.N.mlp.{gate,up,down}_proj.weight             [I, H] / [I, H] / [H, I]
    layers.N.{attention,mlp}_conv.base_kernel           [2, K, H]
    layers.N.{attention,mlp}_conv.kernel_projection.weight  [2 * K * H / G, H]
    candidate_selector.hidden_projection.weight         [rank, H]
    candidate_selector.{predecessor,successor}_codebook [vocab, rank]   (plain parameters, no .weight)

The one difference from the reference's module tree: the reference's codebooks are
``nn.Embedding`` (``...codebook.weight``) and its ``from_pretrained`` renames them; here they are
plain parameters so the state dict IS the checkpoint (see :data:`REFERENCE_KEY_MAP`).

The drafter has no embedding table and no LM head of its own: the target's token embedding and
output head are given as frozen tensors (:meth:`DFlash2Drafter.set_target_weights`, read from a
target GGUF by :mod:`dflash2_gguf.train.target_weights`) and kept as non-persistent buffers.

One draft pass (inference): rows ``[anchor, MASK x (bs-1)]`` at absolute positions
``P .. P+bs-1`` attend (bidirectionally, unless configured causal) to themselves and to the
context rows: the target's features of the committed tokens before ``P``, projected by ``fc``,
normed by ``hidden_norm``, and injected as extra K/V in every layer (own ``k_proj``/``v_proj``,
``k_norm`` on context keys too, RoPE at each context token's absolute position). Context rows
never run through the layers. Training runs many blocks at once (``block_len`` + an attention
mask, see :mod:`dflash2_gguf.train.objective`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from convert.config import build_target_layer_ids, check_selector_lattice, parse_config

__all__ = [
    "DFlash2Config",
    "DFlash2Drafter",
    "REFERENCE_KEY_MAP",
    "build_target_layer_ids",
    "grow_layers",
    "rope_cos_sin",
]

# Our key -> key in the authors' torch module (``DFlash2DraftModel.state_dict()``). The HF
# checkpoint file uses OUR names; only the reference module's nn.Embedding adds ``.weight``.
REFERENCE_KEY_MAP = {
    "candidate_selector.predecessor_codebook": "candidate_selector.predecessor_codebook.weight",
    "candidate_selector.successor_codebook": "candidate_selector.successor_codebook.weight",
}

# HF layer id k = output of decoder layer k = llama.cpp's ``l_out-{k}`` = llama.cpp layer input
# k + 1. The authors' ``extract_context_feature`` indexes ``hidden_states[k + 1]`` (index 0 is the
# embedding output); GGUF ``dflash.target_layers`` stores k + 1.
TARGET_LAYER_OFFSET = 1


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DFlash2Config:
    """Sizes and DFlash 2 settings; mirrors the authors' config.json (``model_type`` qwen3).

    ``hidden_size`` and ``vocab_size`` must equal the target's. Values under ``dflash_config`` in
    config.json: target_layer_ids, mask_token_id, block_size, conv_kernel_size, conv_group_size,
    selector_rank, selector_top_k and the optional output_multiplier, final_logit_softcapping,
    input_embedding_scale.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    is_causal: bool | None = False  # None: causal only on sliding layers (the reference's rule)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError("layer_types must have one entry per layer")
            bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if bad:
                raise ValueError(f"unknown layer_types {sorted(bad)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need sliding_window")
        if self.hidden_size % self.conv_group_size:
            raise ValueError("hidden_size must be a multiple of conv_group_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError("only hidden_act='silu' (SwiGLU) is supported")
        if not 0 < self.selector_top_k <= self.vocab_size:
            raise ValueError("selector_top_k must be in 1..vocab_size")

    def layer_is_sliding(self, i: int) -> bool:
        return self.layer_types is not None and self.layer_types[i] == "sliding_attention"

    # -- the authors' config.json --------------------------------------------------------

    def to_hf_dict(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The config.json dict of the authors' DFlash 2 format (``DFlash2DraftModel``)."""
        dflash: dict[str, Any] = {
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
        }
        for key in ("output_multiplier", "final_logit_softcapping", "input_embedding_scale"):
            if getattr(self, key) is not None:
                dflash[key] = getattr(self, key)
        cfg: dict[str, Any] = {
            "architectures": ["DFlash2DraftModel"],
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "use_cache": True,
            "use_sliding_window": self.layer_types is not None
            and "sliding_attention" in self.layer_types,
            "vocab_size": self.vocab_size,
            "dflash_config": dflash,
        }
        if self.is_causal is not None:
            cfg["is_causal"] = bool(self.is_causal)
        if self.layer_types is not None:
            cfg["layer_types"] = list(self.layer_types)
        return cfg

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> "DFlash2Config":
        """The config of an authors'-format config.json dict, read by the converter's one reader
        (:func:`convert.config.parse_config`: ``dflash_config`` first, then the top level).

        Raises:
            ValueError: not a DFlash 2 config, a missing or bad key (``ConversionError``, a
                ``ValueError``, naming it), or RoPE scaling (the trainer has none).
        """
        c = parse_config(cfg)
        if c.version != 2:
            raise ValueError(f"config.json: {c.architecture} is not a DFlash 2 drafter: training needs "
                             "architectures ['DFlash2DraftModel']")
        if c.num_target_layers is None:
            raise ValueError("config.json lacks 'num_target_layers' (the target's layer count)")
        if c.rope_theta is None:
            raise ValueError("config.json lacks rope_theta / rope_parameters.rope_theta")
        rope_type = c.rope_parameters.get("rope_type", "default")
        if rope_type not in (None, "default"):
            raise ValueError(f"rope scaling {rope_type!r} is not supported by the trainer")
        assert c.conv_kernel_size and c.conv_group_size and c.selector_rank and c.selector_top_k  # version 2
        layer_types = c.layer_types
        if c.sliding_window_pattern is not None and layer_types is None:  # dflash_config.use_swa: every layer
            layer_types = tuple("sliding_attention" if sw else "full_attention" for sw in c.sliding_window_pattern)
        return cls(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            vocab_size=c.vocab_size,
            num_target_layers=c.num_target_layers,
            target_layer_ids=c.target_layer_ids,
            mask_token_id=c.mask_token_id,
            block_size=c.block_size,
            conv_kernel_size=c.conv_kernel_size,
            conv_group_size=c.conv_group_size,
            selector_rank=c.selector_rank,
            selector_top_k=c.selector_top_k,
            rms_norm_eps=1e-6 if c.rms_norm_eps is None else c.rms_norm_eps,
            rope_theta=c.rope_theta,
            max_position_embeddings=40960 if c.context_length is None else c.context_length,
            is_causal=c.causal,
            sliding_window=c.sliding_window,
            layer_types=layer_types,
            output_multiplier=c.output_multiplier,
            final_logit_softcapping=c.final_logit_softcapping,
            input_embedding_scale=c.input_embedding_scale,
            hidden_act=c.hidden_act,
        )

    @classmethod
    def for_target(cls, info: Any, *, num_hidden_layers: int = 5, block_size: int = 16,
                   target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
                   **overrides: Any) -> "DFlash2Config":
        """A drafter shaped like the target (``info``: :class:`~.target_weights.TargetInfo`):
        same hidden size, heads, head dim, FFN width, RoPE base and norm eps, as the authors'
        drafters copy their target's Qwen3 sizes; layer ids by :func:`build_target_layer_ids`.
        llama.cpp needs ``hidden_size >= top_k * (top_k + 1)`` (the lattice rows).

        Raises:
            ValueError: the drafter is narrower than its selector lattice
                (:func:`convert.config.check_selector_lattice`), or a target layer id is out of range.
        """
        kw: dict[str, Any] = dict(
            hidden_size=info.hidden_size,
            intermediate_size=info.n_ff or 3 * info.hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=info.n_head,
            num_key_value_heads=info.n_head_kv or info.n_head,
            head_dim=info.head_dim or info.hidden_size // info.n_head,
            vocab_size=info.vocab_size,
            num_target_layers=info.n_layers,
            target_layer_ids=tuple(target_layer_ids if target_layer_ids is not None
                                   else build_target_layer_ids(info.n_layers, num_hidden_layers)),
            mask_token_id=mask_token_id if mask_token_id is not None else info.default_mask_token_id(),
            block_size=block_size,
            rms_norm_eps=info.rms_norm_eps or 1e-6,
            rope_theta=info.rope_theta or 1_000_000.0,
        )
        kw.update(overrides)
        cfg = cls(**kw)
        check_selector_lattice(cfg.hidden_size, cfg.selector_top_k)
        bad = [k for k in cfg.target_layer_ids if not 0 <= k < info.n_layers]
        if bad:
            raise ValueError(f"target layer ids {bad} out of range for {info.n_layers} layers")
        return cfg

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``, computed in float32, cast back before the weight.

    Same numerics as Qwen3RMSNorm (transformers) that the reference uses. Norm weights are
    stored as they are (no +1 shift).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (unscaled) RoPE tables for integer ``positions`` [B, T] -> cos, sin [B, T, hd].

    ``inv_freq[i] = theta ** (-2i / hd)``, angles in float32, duplicated halves (the
    ``rotate_half`` convention of HF / NeoX), cast to ``dtype``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                             device=positions.device) / head_dim))
    freqs = positions[..., None].to(torch.float32) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE: x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashAttention(nn.Module):
    """GQA attention of the block rows over [context rows, block rows].

    q from block rows only; k/v from both (same ``k_proj``/``v_proj``); per-head RMSNorm on q and
    on ALL keys (context keys included), then RoPE at absolute positions; scale ``hd**-0.5``.
    """

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.n_head = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_head * hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, H] block rows; ctx [B, C, H] normed context rows; cos/sin [B, C+Q, hd]
        (context positions first); mask bool [B|1, 1, Q, C+Q] (True = may attend) or None
        (everything visible). Returns [B, Q, H]."""
        b, q_len, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], self.n_kv, self.head_dim).transpose(1, 2)
        q = _rotate(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rotate(k, cos, sin)
        groups = self.n_head // self.n_kv
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedDynamicConv(nn.Module):
    """DFlash 2's dynamic K-tap grouped depthwise conv around one sublayer.

    ``y_t[c] = sum_{tap<K} (base[side, tap, c] + dyn_t[side, tap, c // G]) * x_{t-tap}[c]``
    with ``dyn_t = kernel_projection(u_t)`` viewed as [2 sides, K taps, H/G groups], ``u`` the
    normed sublayer input; side 0 filters the sublayer's input (:meth:`pre`), side 1 its output
    (:meth:`post`), both with the kernels of the same ``u_t``. Taps never cross a block: each
    block's row 0 reads zeros for ``x_{-1}`` (``block_len`` rows per block, blocks laid out
    back to back along the row axis).
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0  # identity at init
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, dyn: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
        """x [B, Q, H]; dyn [B, Q, 2, K, groups]; Q a multiple of block_len."""
        b, q_len, h = x.shape
        nb = q_len // block_len
        xs = x.view(b, nb, block_len, self.groups, self.group_size)
        dyn = dyn[:, :, side].reshape(b, nb, block_len, self.kernel_size, self.groups, 1)
        out = torch.zeros_like(xs)
        for tap in range(self.kernel_size):
            shifted = xs if tap == 0 else F.pad(xs[:, :, :-tap], (0, 0, 0, 0, tap, 0))
            base = self.base_kernel[side, tap].view(self.groups, self.group_size).to(x.dtype)
            out = out + base * shifted + dyn[:, :, :, tap] * shifted
        return out.view(b, q_len, h)

    def pre(self, u: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """u [B, Q, H] normed sublayer input -> (filtered input, dynamic kernels for :meth:`post`)."""
        dyn = self.kernel_projection(u).view(*u.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(u, dyn, 0, block_len), dyn

    def post(self, y: torch.Tensor, dyn: torch.Tensor, block_len: int) -> torch.Tensor:
        """y [B, Q, H] sublayer output -> filtered output."""
        return self._convolve(y, dyn, 1, block_len)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x += conv_post(attn(conv_pre(norm(x)), ctx))``, then the same for the
    MLP (``mlp_conv`` around ``mlp``)."""

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, block_len: int) -> torch.Tensor:
        u, dyn = self.attention_conv.pre(self.input_layernorm(x), block_len)
        x = x + self.attention_conv.post(self.self_attn(u, ctx, cos, sin, mask), dyn, block_len)
        u, dyn = self.mlp_conv.pre(self.post_attention_layernorm(x), block_len)
        return x + self.mlp_conv.post(self.mlp(u), dyn, block_len)


class CandidateSelector(nn.Module):
    """DFlash 2 candidate selector over the top-k draft logits of each row.

    ``S_t(a, b) = U_t(b) + sum_r A[a, r] * (W h_t)[r] * B[b, r]`` for candidate ``b`` (one of the
    top-k ids of row t, ``U_t(b)`` its scaled/softcapped logit) after predecessor ``a``;
    A = ``predecessor_codebook``, B = ``successor_codebook`` [vocab, rank],
    W = ``hidden_projection`` [rank, H], h_t the post-norm drafter row.
    """

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V] -> (unary [..., k], candidate ids [..., k]); unsorted like the reference."""
        return torch.topk(logits, self.top_k, dim=-1, sorted=False)

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """Teacher-forced scores. hidden [..., H]; unary/candidates [..., k]; predecessors [...]
        (token ids). Returns S [..., k] float."""
        proj = self.hidden_projection(hidden)
        left = self.predecessor_codebook[predecessors] * proj            # [..., r]
        right = self.successor_codebook[candidates]                      # [..., k, r]
        return unary + torch.einsum("...r,...kr->...k", left, right)

    @torch.no_grad()
    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor,
               temperature: float = 0.0, vocab: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Walk the rows left to right: greedy argmax at ``temperature`` 0, else sample from
        ``softmax(S / T)``. hidden [B, T, H]; logits [B, T, V] (or [B, T, len(vocab)]: the head
        rows ``vocab``, sorted int64 token ids, as :meth:`DFlash2Drafter.compute_logits` gives
        them); anchor_ids [B]. Returns (path [B, T], candidates [B, T, k] (token ids),
        q [B, T, k] or None)."""
        unary, cand = self.candidates(logits)
        if vocab is not None:
            cand = vocab[cand]
        pred = anchor_ids
        path, qs = [], []
        for t in range(hidden.shape[1]):
            s = self.scores(hidden[:, t], unary[:, t], cand[:, t], pred)
            if temperature > 0:
                q = torch.softmax(s.float() / temperature, dim=-1)
                idx = torch.multinomial(q, 1)[:, 0]
                qs.append(q)
            else:
                idx = s.argmax(-1)
            pred = cand[:, t].gather(-1, idx[:, None])[:, 0]
            path.append(pred)
        return torch.stack(path, 1), cand, (torch.stack(qs, 1) if qs else None)


# --------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------


class DFlash2Drafter(nn.Module):
    """DFlash 2 drafter: ``fc`` + ``hidden_norm`` over concatenated target features, decoder
    layers with context K/V injection and dynamic convs, final ``norm``, candidate selector.

    Target weights (frozen, not in the state dict): ``embed_tokens`` [V, H] and ``lm_head``
    [V, H] set by :meth:`set_target_weights`.
    """

    def __init__(self, cfg: DFlash2Config, *, init_std: float = 0.02) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg)
        self.register_buffer("embed_tokens", None, persistent=False)
        self.register_buffer("lm_head", None, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=init_std)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def set_target_weights(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None) -> None:
        """Attach the target's token embedding [V, H] and output head [V, H] (tied when None),
        as frozen non-persistent buffers (never trained, never exported)."""
        v, h = self.config.vocab_size, self.config.hidden_size
        head = embed_tokens if lm_head is None else lm_head
        for name, t in (("embed_tokens", embed_tokens), ("lm_head", head)):
            if tuple(t.shape) != (v, h):
                raise ValueError(f"target {name} has shape {tuple(t.shape)}, expected {(v, h)}")
        self.embed_tokens = embed_tokens.detach()
        self.lm_head = head.detach() if lm_head is not None else self.embed_tokens

    # -- inputs / outputs through the target's tensors ------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> target embeddings [..., H] times ``input_embedding_scale``."""
        if self.embed_tokens is None:
            raise RuntimeError("call set_target_weights() first")
        scale = self.config.input_embedding_scale
        e = F.embedding(ids, self.embed_tokens)
        return e * float(scale) if scale is not None else e

    def compute_logits(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V]: ``lm_head(h) * output_multiplier``, then
        ``tanh(l / cap) * cap`` when ``final_logit_softcapping`` > 0 (as the reference).
        ``vocab`` (int64 ids): logits of those head rows only, [..., len(vocab)] (training
        over a restricted vocabulary)."""
        if self.lm_head is None:
            raise RuntimeError("call set_target_weights() first")
        head = self.lm_head if vocab is None else self._head_rows(vocab)
        logits = F.linear(hidden, head.to(hidden.dtype))
        mult = self.config.output_multiplier
        logits = logits * float(mult if mult is not None else 1.0)
        cap = self.config.final_logit_softcapping
        if cap is not None and float(cap) > 0:
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits

    def _head_rows(self, vocab: torch.Tensor) -> torch.Tensor:
        cache = getattr(self, "_head_cache", None)
        if cache is None or cache[0] is not vocab or cache[1].device != self.lm_head.device:
            self._head_cache = (vocab, self.lm_head[vocab.to(self.lm_head.device)].contiguous())
        return self._head_cache[1]

    # -- the forward pass ----------------------------------------------------------------

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor,
                position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                block_len: int | None = None, feature_dropout: float = 0.0) -> torch.Tensor:
        """Run the block rows; returns post-``norm`` hidden [B, Q, H].

        Args:
            noise_embedding: [B, Q, H] embeddings of the block rows (anchor, masks, ...).
            target_hidden: [B, C, n_feat*H] raw target features of the context rows (C may be 0).
            position_ids: [B, C+Q] absolute positions, context rows first (as the reference).
            attention_mask: bool [B|1, 1, Q, C+Q], True = visible; None = all visible. Causal
                and sliding-window limits of the config are ANDed in, from positions.
            block_len: rows per block for the convs' zero padding (default Q: one block).
            feature_dropout: dropout probability on the fused context rows (``hidden_norm(fc(.))``,
                elementwise, scaled by ``1 / (1 - p)``), applied only in training mode: a
                regulariser for the small-data regime (docs/TRAINING.md); 0 at inference.
        """
        q_len = noise_embedding.shape[1]
        block_len = q_len if block_len is None else block_len
        if q_len % block_len:
            raise ValueError(f"{q_len} block rows is not a multiple of block_len {block_len}")
        ctx = self.hidden_norm(self.fc(target_hidden.to(noise_embedding.dtype)))
        if feature_dropout:
            ctx = nn.functional.dropout(ctx, feature_dropout, training=self.training)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta,
                                noise_embedding.dtype)
        masks = self._layer_masks(attention_mask, position_ids, q_len)
        x = noise_embedding
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, cos, sin, masks[i], block_len)
        return self.norm(x)

    def _layer_masks(self, base: torch.Tensor | None, pos: torch.Tensor, q_len: int) -> list:
        """Per-layer boolean masks: ``base`` AND (causal: k_pos <= q_pos) AND (sliding window
        w: q_pos - k_pos < w, and k_pos - q_pos < w when not causal), as the reference."""
        cfg = self.config
        cache: dict[tuple[bool, int | None], torch.Tensor | None] = {}
        out = []
        for i in range(cfg.num_hidden_layers):
            sliding = cfg.layer_is_sliding(i)
            # The reference: is_causal from config when given, else causal only on sliding layers.
            causal = bool(cfg.is_causal) if cfg.is_causal is not None else sliding
            window = cfg.sliding_window if sliding else None
            key = (causal, window)
            if key not in cache:
                m = base
                if causal or window is not None:
                    qp = pos[:, -q_len:, None]
                    kp = pos[:, None, :]
                    extra = torch.ones(qp.shape[0], q_len, pos.shape[1], dtype=torch.bool, device=pos.device)
                    if causal:
                        extra &= kp <= qp
                    if window is not None:
                        extra &= (qp - kp) < window
                        if not causal:
                            extra &= (kp - qp) < window
                    extra = extra[:, None]
                    m = extra if m is None else (m & extra)
                cache[key] = m
            out.append(cache[key])
        return out

    # -- inference helpers (same behaviour as the reference) ------------------------------

    @torch.no_grad()
    def draft(self, target_hidden: torch.Tensor, anchor_ids: torch.Tensor, start: int,
              temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One full-block draft pass after context rows at positions ``start-C .. start-1``.

        target_hidden [B, C, n_feat*H]; anchor_ids [B]. Returns the selector's
        (path [B, bs-1], candidates [B, bs-1, k], q or None) for rows 1..bs-1.
        """
        bs = self.config.block_size
        b, c = target_hidden.shape[:2]
        ids = torch.full((b, bs), self.config.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        pos = torch.arange(start - c, start + bs, device=anchor_ids.device).expand(b, -1)
        h = self.forward(self.embed(ids), target_hidden, pos)[:, 1:]
        return self.candidate_selector.select(h, self.compute_logits(h), anchor_ids, temperature)


def grow_layers(model: DFlash2Drafter, num_hidden_layers: int, *, seed: int = 0) -> DFlash2Drafter:
    """A deeper drafter that computes exactly what ``model`` computes: ``model``'s weights, and
    ``num_hidden_layers - model.config.num_hidden_layers`` decoder layers appended after its last
    one, each an identity at the start (its ``self_attn.o_proj`` and ``mlp.down_proj`` zero, so
    both residual branches add 0; the conv kernels, norms and other projections initialised as a
    fresh drafter's, with ``seed``). Training then moves the new layers off the identity: the
    zero-initialised residual branch of ReZero / "Fixup" (Bachlechner et al. 2020, Zhang et al.
    2019), used here to try a deeper drafter without losing what the shallower one learnt.

    Args:
        model: the drafter to extend (float32 or any dtype; the result has its dtype). Its
            target weights, when attached, are attached to the result too.
        num_hidden_layers: the new depth, larger than ``model``'s.
        seed: torch seed for the new layers' non-zero weights.

    Returns:
        a new :class:`DFlash2Drafter`; ``model`` is left unchanged.

    Raises:
        ValueError: ``num_hidden_layers`` is not larger than the model's, or the model's config
            lists ``layer_types`` (which layer kind a new layer gets is not defined).
    """
    import dataclasses

    cfg = model.config
    if num_hidden_layers <= cfg.num_hidden_layers:
        raise ValueError(f"grow_layers: {num_hidden_layers} layers is not more than the drafter's "
                         f"{cfg.num_hidden_layers}")
    if cfg.layer_types is not None:
        raise ValueError("grow_layers: the drafter's config lists layer_types; a grown drafter "
                         "would need one per new layer")
    dtype = next(model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):  # the caller's RNG state is left as it was
        torch.manual_seed(seed)
        grown = DFlash2Drafter(dataclasses.replace(cfg, num_hidden_layers=num_hidden_layers)).to(dtype)
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers.") for k in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in grown.layers[cfg.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    if model.embed_tokens is not None:
        grown.set_target_weights(model.embed_tokens, model.lm_head)
    return grown
