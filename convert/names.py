"""The one table of dflash names: architecture, metadata keys (with value types) and tensors.

PyPI ``gguf`` 0.19.0 lacks the dflash constants that llama.cpp's in-repo gguf-py has at commit
0c1e570 (the copy llama-cpp-python 0.3.36 vendors, ``vendor/llama.cpp/gguf-py/gguf/constants.py``).
Every name below is spelled as upstream spells it; each entry records the upstream constant it
mirrors (``Keys.<group>.<NAME>`` or ``MODEL_TENSOR.<NAME>``) so that
``tests/convert/test_convert.py::test_names_match_upstream`` can check the table against that file.

Value types are the ones upstream's ``GGUFWriter.add_*`` methods write (``add_uint32``,
``add_float32``, ``add_bool``; ``add_array`` of Python ints writes INT32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGUFValueType as VT

__all__ = ["ARCH", "TARGET_LAYER_OFFSET", "KEYS", "Key", "key", "TENSORS", "TensorRule",
           "map_tensor_name"]

#: ``general.architecture`` of a DFlash / DFlash 2 / DSpark drafter (``MODEL_ARCH.DFLASH``).
ARCH = "dflash"

#: HF ``target_layer_ids`` name the OUTPUT of a target decoder layer; llama.cpp indexes layer
#: INPUTS, where index 0 is the embedding output. ``dflash.target_layers`` = HF id + this.
TARGET_LAYER_OFFSET = 1


@dataclass(frozen=True)
class Key:
    """One metadata key: upstream constant path, name template, value type (array sub-type)."""

    upstream: str
    template: str
    vtype: VT
    sub_type: VT | None = None

    def name(self, arch: str = ARCH) -> str:
        return self.template.format(arch=arch)


KEYS: dict[str, Key] = {
    "architecture":          Key("General.ARCHITECTURE", "general.architecture", VT.STRING),
    "type":                  Key("General.TYPE", "general.type", VT.STRING),
    "name":                  Key("General.NAME", "general.name", VT.STRING),
    "size_label":            Key("General.SIZE_LABEL", "general.size_label", VT.STRING),
    "file_type":             Key("General.FILE_TYPE", "general.file_type", VT.UINT32),
    "quantization_version":  Key("General.QUANTIZATION_VERSION", "general.quantization_version", VT.UINT32),
    "block_count":           Key("LLM.BLOCK_COUNT", "{arch}.block_count", VT.UINT32),
    "context_length":        Key("LLM.CONTEXT_LENGTH", "{arch}.context_length", VT.UINT32),
    "embedding_length":      Key("LLM.EMBEDDING_LENGTH", "{arch}.embedding_length", VT.UINT32),
    "feed_forward_length":   Key("LLM.FEED_FORWARD_LENGTH", "{arch}.feed_forward_length", VT.UINT32),
    "vocab_size":            Key("LLM.VOCAB_SIZE", "{arch}.vocab_size", VT.UINT32),
    "logit_scale":           Key("LLM.LOGIT_SCALE", "{arch}.logit_scale", VT.FLOAT32),
    "final_logit_softcapping": Key("LLM.FINAL_LOGIT_SOFTCAPPING", "{arch}.final_logit_softcapping", VT.FLOAT32),
    "embedding_scale":       Key("LLM.EMBEDDING_SCALE", "{arch}.embedding_scale", VT.FLOAT32),
    "target_layers":         Key("LLM.TARGET_LAYERS", "{arch}.target_layers", VT.ARRAY, VT.INT32),
    "block_size":            Key("LLM.BLOCK_SIZE", "{arch}.block_size", VT.UINT32),
    "conv_kernel_size":      Key("LLM.CONV_KERNEL_SIZE", "{arch}.conv_kernel_size", VT.UINT32),
    "conv_group_size":       Key("LLM.CONV_GROUP_SIZE", "{arch}.conv_group_size", VT.UINT32),
    "selector_rank":         Key("LLM.SELECTOR_RANK", "{arch}.selector_rank", VT.UINT32),
    "selector_top_k":        Key("LLM.SELECTOR_TOP_K", "{arch}.selector_top_k", VT.UINT32),
    "sample_from_anchor":    Key("LLM.SAMPLE_FROM_ANCHOR", "{arch}.sample_from_anchor", VT.BOOL),
    "head_count":            Key("Attention.HEAD_COUNT", "{arch}.attention.head_count", VT.UINT32),
    "head_count_kv":         Key("Attention.HEAD_COUNT_KV", "{arch}.attention.head_count_kv", VT.UINT32),
    "key_length":            Key("Attention.KEY_LENGTH", "{arch}.attention.key_length", VT.UINT32),
    "value_length":          Key("Attention.VALUE_LENGTH", "{arch}.attention.value_length", VT.UINT32),
    "layer_norm_rms_eps":    Key("Attention.LAYERNORM_RMS_EPS", "{arch}.attention.layer_norm_rms_epsilon", VT.FLOAT32),
    "causal":                Key("Attention.CAUSAL", "{arch}.attention.causal", VT.BOOL),
    "sliding_window":        Key("Attention.SLIDING_WINDOW", "{arch}.attention.sliding_window", VT.UINT32),
    "sliding_window_pattern": Key("Attention.SLIDING_WINDOW_PATTERN", "{arch}.attention.sliding_window_pattern", VT.ARRAY, VT.BOOL),
    "value_scale":           Key("Attention.VALUE_SCALE", "{arch}.attention.value_scale", VT.FLOAT32),
    "rope_dimension_count":  Key("Rope.DIMENSION_COUNT", "{arch}.rope.dimension_count", VT.UINT32),
    "rope_dimension_sections": Key("Rope.DIMENSION_SECTIONS", "{arch}.rope.dimension_sections", VT.ARRAY, VT.INT32),
    "rope_freq_base":        Key("Rope.FREQ_BASE", "{arch}.rope.freq_base", VT.FLOAT32),
    "rope_freq_base_swa":    Key("Rope.FREQ_BASE_SWA", "{arch}.rope.freq_base_swa", VT.FLOAT32),
    "rope_scaling_type":     Key("Rope.SCALING_TYPE", "{arch}.rope.scaling.type", VT.STRING),
    "rope_scaling_factor":   Key("Rope.SCALING_FACTOR", "{arch}.rope.scaling.factor", VT.FLOAT32),
    "rope_scaling_orig_ctx_len": Key("Rope.SCALING_ORIG_CTX_LEN", "{arch}.rope.scaling.original_context_length", VT.UINT32),
    "rope_yarn_ext_factor":  Key("Rope.SCALING_YARN_EXT_FACTOR", "{arch}.rope.scaling.yarn_ext_factor", VT.FLOAT32),
    "rope_yarn_attn_factor": Key("Rope.SCALING_YARN_ATTN_FACTOR", "{arch}.rope.scaling.yarn_attn_factor", VT.FLOAT32),
    "rope_yarn_beta_fast":   Key("Rope.SCALING_YARN_BETA_FAST", "{arch}.rope.scaling.yarn_beta_fast", VT.FLOAT32),
    "rope_yarn_beta_slow":   Key("Rope.SCALING_YARN_BETA_SLOW", "{arch}.rope.scaling.yarn_beta_slow", VT.FLOAT32),
    "mask_token_id":         Key("Tokenizer.MASK_ID", "tokenizer.ggml.mask_token_id", VT.UINT32),
}


def key(alias: str, arch: str = ARCH) -> str:
    """Full key name of table entry ``alias`` (e.g. ``key("block_size") == "dflash.block_size"``)."""
    return KEYS[alias].name(arch)


@dataclass(frozen=True)
class TensorRule:
    """HF name pattern -> GGUF name, plus the class that decides the stored dtype.

    ``kind``: ``"norm"`` (1-D RMSNorm weights, always F32), ``"base"`` (conv base kernels: no
    ``.weight`` suffix, so upstream always stores them F32), ``"matrix"`` (the requested type).
    ``suffix`` is appended to the GGUF name (upstream appends ``.weight`` to the codebooks).
    """

    upstream: str          # MODEL_TENSOR member whose TENSOR_NAMES template is ``gguf``
    hf: str                # regex on the HF name, ``(?P<bid>\d+)`` for the layer
    gguf: str              # upstream template, ``{bid}`` for the layer
    suffix: str
    kind: str
    v2_only: bool = False


_L = r"layers\.(?P<bid>\d+)\."
TENSORS: tuple[TensorRule, ...] = (
    TensorRule("FC", r"fc\.weight", "fc", ".weight", "matrix"),
    TensorRule("ENC_OUTPUT_NORM", r"hidden_norm\.weight", "enc.output_norm", ".weight", "norm"),
    TensorRule("OUTPUT_NORM", r"norm\.weight", "output_norm", ".weight", "norm"),
    TensorRule("ATTN_NORM", _L + r"input_layernorm\.weight", "blk.{bid}.attn_norm", ".weight", "norm"),
    TensorRule("FFN_NORM", _L + r"post_attention_layernorm\.weight", "blk.{bid}.ffn_norm", ".weight", "norm"),
    TensorRule("ATTN_Q", _L + r"self_attn\.q_proj\.weight", "blk.{bid}.attn_q", ".weight", "matrix"),
    TensorRule("ATTN_K", _L + r"self_attn\.k_proj\.weight", "blk.{bid}.attn_k", ".weight", "matrix"),
    TensorRule("ATTN_V", _L + r"self_attn\.v_proj\.weight", "blk.{bid}.attn_v", ".weight", "matrix"),
    TensorRule("ATTN_OUT", _L + r"self_attn\.o_proj\.weight", "blk.{bid}.attn_output", ".weight", "matrix"),
    TensorRule("ATTN_Q_NORM", _L + r"self_attn\.q_norm\.weight", "blk.{bid}.attn_q_norm", ".weight", "norm"),
    TensorRule("ATTN_K_NORM", _L + r"self_attn\.k_norm\.weight", "blk.{bid}.attn_k_norm", ".weight", "norm"),
    TensorRule("FFN_GATE", _L + r"mlp\.gate_proj\.weight", "blk.{bid}.ffn_gate", ".weight", "matrix"),
    TensorRule("FFN_UP", _L + r"mlp\.up_proj\.weight", "blk.{bid}.ffn_up", ".weight", "matrix"),
    TensorRule("FFN_DOWN", _L + r"mlp\.down_proj\.weight", "blk.{bid}.ffn_down", ".weight", "matrix"),
    TensorRule("DFLASH_ATTN_CONV_BASE", _L + r"attention_conv\.base_kernel", "blk.{bid}.attn_conv_base", "", "base", True),
    TensorRule("DFLASH_ATTN_CONV_PROJ", _L + r"attention_conv\.kernel_projection\.weight", "blk.{bid}.attn_conv_proj", ".weight", "matrix", True),
    TensorRule("DFLASH_FFN_CONV_BASE", _L + r"mlp_conv\.base_kernel", "blk.{bid}.ffn_conv_base", "", "base", True),
    TensorRule("DFLASH_FFN_CONV_PROJ", _L + r"mlp_conv\.kernel_projection\.weight", "blk.{bid}.ffn_conv_proj", ".weight", "matrix", True),
    TensorRule("DFLASH_SELECTOR_HIDDEN", r"candidate_selector\.hidden_projection\.weight", "selector_hidden", ".weight", "matrix", True),
    TensorRule("DFLASH_SELECTOR_PREV", r"candidate_selector\.predecessor_codebook", "selector_predecessor", ".weight", "matrix", True),
    TensorRule("DFLASH_SELECTOR_NEXT", r"candidate_selector\.successor_codebook", "selector_successor", ".weight", "matrix", True),
)

_COMPILED = [(re.compile(r.hf + r"\Z"), r) for r in TENSORS]


def map_tensor_name(hf_name: str) -> tuple[str, TensorRule] | None:
    """Map an authors' tensor name (no ``model.`` prefix) to ``(gguf_name, rule)``, or None."""
    for rx, rule in _COMPILED:
        m = rx.match(hf_name)
        if m:
            bid = m.groupdict().get("bid")
            return rule.gguf.format(bid=bid) + rule.suffix, rule
    return None
