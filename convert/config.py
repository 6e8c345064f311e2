"""Parse a drafter's ``config.json`` once into a frozen :class:`DraftConfig`.

The one reader of a drafter's Hugging Face config: the converter uses it, and so does training
(``DFlash2Config.from_hf_dict`` in ``dflash2_gguf/train/model.py``).

One lookup rule (the authors' ``_draft_value`` in ``dflash/model.py``): a DFlash setting is read
from ``dflash_config`` first, then from the top level. Plain Qwen3 sizes are top-level only.
Required keys that are missing raise :class:`~convert.errors.ConversionError`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConversionError, read_json

__all__ = ["DraftConfig", "parse_config", "ARCHITECTURES", "build_target_layer_ids", "check_selector_lattice"]

logger = logging.getLogger(__name__)

#: HF ``architectures[0]`` -> drafter version.
ARCHITECTURES = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2}

_MISSING = object()


def _draft_value(cfg: Mapping[str, Any], name: str, default: Any = _MISSING, *, what: str = "") -> Any:
    """``dflash_config[name]``, else top-level ``name``, else ``default`` (raise if none)."""
    dcfg = cfg.get("dflash_config") or {}
    if name in dcfg and dcfg[name] is not None:
        return dcfg[name]
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if default is _MISSING:
        raise ConversionError(f"config.json: missing required key {name!r} "
                              f"(looked in dflash_config, then the top level){what}")
    return default


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The authors' default choice of target layers (HF ids), one per drafter layer.

    Evenly spaced from layer 1 to layer ``num_target_layers - 3`` (Python ``round``, i.e. round
    half to even, as the reference); a 1-layer drafter takes the middle layer.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + i * (last - first) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def check_selector_lattice(hidden_size: int, selector_top_k: int) -> None:
    """Refuse a DFlash 2 drafter narrower than its selector lattice.

    llama.cpp packs the selector's ``top_k * (top_k + 1)`` lattice scores into the drafter's
    ``hidden_size`` output rows, so it refuses a drafter with ``hidden_size < top_k * (top_k + 1)``.

    Raises:
        ConversionError: (a ``ValueError``) the drafter is too narrow; the message gives the
            largest ``selector_top_k`` that fits.
    """
    need = selector_top_k * (selector_top_k + 1)
    if hidden_size < need:
        fits = 0
        while (fits + 1) * (fits + 2) <= hidden_size:
            fits += 1
        raise ConversionError(
            f"DFlash 2 hidden_size {hidden_size} is below selector_top_k*(selector_top_k+1) = {need} "
            f"(selector_top_k {selector_top_k}): llama.cpp packs the selector lattice into the hidden-size "
            f"output rows and refuses such a drafter; use selector_top_k <= {fits} or a wider drafter")


def _top(cfg: Mapping[str, Any], name: str, default: Any = _MISSING) -> Any:
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if default is _MISSING:
        raise ConversionError(f"config.json: missing required key {name!r}")
    return default


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ConversionError(f"config.json: {name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class DraftConfig:
    """Everything the converter needs from ``config.json``, typed and validated.

    ``target_layer_ids`` are HF ids (output of that target layer); GGUF stores them plus
    :data:`convert.names.TARGET_LAYER_OFFSET`. A config without them gets the authors' default
    (:func:`build_target_layer_ids` of ``num_target_layers``). Optional values are ``None`` when
    absent, which means "do not write the key", as upstream's
    ``DFlashModel.set_gguf_parameters`` does. ``layer_types`` is the config's list as given;
    ``sliding_window`` / ``sliding_window_pattern`` are set only when sliding attention is on.
    """

    architecture: str
    version: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_explicit: bool
    vocab_size: int
    rms_norm_eps: float | None
    context_length: int | None
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    causal: bool | None
    rope_theta: float | None
    rope_parameters: Mapping[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float | None = None
    attention_value_scale: float | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    input_embedding_scale: float | None = None
    sliding_window: int | None = None
    sliding_window_pattern: tuple[bool, ...] | None = None
    num_target_layers: int | None = None
    rope_is_neox_style: bool = True
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)


def parse_config(path_or_dict: str | Path | Mapping[str, Any]) -> DraftConfig:
    """Read and validate a drafter config (``config.json`` path, its folder, or a dict).

    Raises:
        ConversionError: unreadable JSON, unknown architecture, missing required keys, or
            inconsistent values (conv group size not dividing hidden size, DFlash 2 hidden size
            below ``top_k * (top_k + 1)``, mask token outside the vocabulary, bad
            ``layer_types``, negative target layer ids).
    """
    if isinstance(path_or_dict, Mapping):
        cfg = dict(path_or_dict)
    else:
        p = Path(path_or_dict)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConversionError(f"no config.json in {p.parent}")
        cfg = read_json(p)
    if not isinstance(cfg, dict):
        raise ConversionError("config.json must hold a JSON object")

    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise ConversionError(
            f"unknown drafter architecture {arch!r}: expected one of {sorted(ARCHITECTURES)} "
            "(config.json 'architectures')")
    version = ARCHITECTURES[arch]

    hidden = _int(_top(cfg, "hidden_size"), "hidden_size")
    n_head = _int(_top(cfg, "num_attention_heads"), "num_attention_heads")
    head_dim_raw = cfg.get("head_dim")
    head_dim = _int(head_dim_raw, "head_dim") if head_dim_raw is not None else hidden // n_head
    vocab = _int(_top(cfg, "vocab_size"), "vocab_size")
    n_layers = _int(_top(cfg, "num_hidden_layers"), "num_hidden_layers")

    ntl = cfg.get("num_target_layers")
    # the authors' default when the config names no layers (DFlash2DraftModel.__init__)
    default_ids = _MISSING if ntl is None else build_target_layer_ids(_int(ntl, "num_target_layers"), n_layers)
    ids_raw = _draft_value(cfg, "target_layer_ids", default_ids)
    if not isinstance(ids_raw, (list, tuple)) or not ids_raw:
        raise ConversionError(f"config.json: target_layer_ids must be a non-empty list, got {ids_raw!r}")
    ids = tuple(_int(i, "target_layer_ids[]") for i in ids_raw)
    if min(ids) < 0:
        raise ConversionError(f"config.json: negative target layer id in {list(ids)}")
    mask = _int(_draft_value(cfg, "mask_token_id"), "mask_token_id")
    if not 0 <= mask < vocab:
        raise ConversionError(f"mask_token_id {mask} is outside the drafter vocabulary [0, {vocab})")

    # Rope: transformers 5 nests rope_theta in rope_parameters; older configs keep it top-level
    # with an optional rope_scaling dict (upstream TextModel mirrors the two the same way).
    rope_params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "full_attention" in rope_params:
        rope_params = dict(rope_params["full_attention"])
    rope_theta = rope_params.get("rope_theta", cfg.get("rope_theta"))
    if "rope_type" not in rope_params and "type" in rope_params:
        rope_params["rope_type"] = rope_params["type"]
    prf = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))

    # DFlash 2 parts.
    conv_k = conv_g = sel_rank = sel_top_k = None
    if version == 2:
        conv_k = _int(_draft_value(cfg, "conv_kernel_size"), "conv_kernel_size")
        conv_g = _int(_draft_value(cfg, "conv_group_size"), "conv_group_size")
        sel_rank = _int(_draft_value(cfg, "selector_rank"), "selector_rank")
        sel_top_k = _int(_draft_value(cfg, "selector_top_k"), "selector_top_k")
        if conv_g <= 0 or hidden % conv_g:
            raise ConversionError(f"conv_group_size {conv_g} does not divide hidden_size {hidden}")
        if conv_k <= 0 or sel_rank <= 0 or sel_top_k <= 0:
            raise ConversionError("conv_kernel_size, selector_rank and selector_top_k must be positive")
        check_selector_lattice(hidden, sel_top_k)

    # Causal flag: upstream writes it only when is_causal (top level) or dflash_config.causal is set.
    causal = cfg.get("is_causal")
    if causal is None:
        causal = (cfg.get("dflash_config") or {}).get("causal")

    # Sliding window, as upstream: use_sliding_window (or dflash_config.use_swa) and a window.
    dcfg = cfg.get("dflash_config") or {}
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            raise ConversionError(f"config.json: layer_types must list {n_layers} entries, got {layer_types!r}")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ConversionError(f"config.json: unknown layer_types {unknown}")
        if "sliding_attention" in layer_types and not (dcfg.get("swa_window_size") or cfg.get("sliding_window")):
            raise ConversionError("config.json: layer_types has sliding_attention but no sliding_window")
    use_swa = bool(cfg.get("use_sliding_window", False) or dcfg.get("use_swa", False))
    window = dcfg.get("swa_window_size") or cfg.get("sliding_window")
    sw = pattern = None
    if use_swa and window:
        sw = _int(window, "sliding_window")
        if dcfg.get("use_swa", False):
            pattern = (True,) * n_layers
        else:
            pattern = tuple(lt == "sliding_attention" for lt in layer_types or [])
    elif layer_types and "sliding_attention" in layer_types:
        logger.warning("layer_types has sliding_attention layers but use_sliding_window is false: "
                       "no sliding-window keys are written (as upstream)")

    def opt_float(name: str) -> float | None:
        v = _draft_value(cfg, name, None)
        return None if v is None else float(v)

    softcap = opt_float("final_logit_softcapping")
    if softcap is not None and softcap <= 0:
        softcap = None

    return DraftConfig(
        architecture=arch,
        version=version,
        hidden_size=hidden,
        intermediate_size=_int(_top(cfg, "intermediate_size"), "intermediate_size"),
        num_layers=n_layers,
        num_heads=n_head,
        num_kv_heads=_int(_top(cfg, "num_key_value_heads", n_head), "num_key_value_heads"),
        head_dim=head_dim,
        head_dim_explicit=head_dim_raw is not None,
        vocab_size=vocab,
        rms_norm_eps=None if cfg.get("rms_norm_eps") is None else float(cfg["rms_norm_eps"]),
        context_length=None if cfg.get("max_position_embeddings") is None
        else _int(cfg["max_position_embeddings"], "max_position_embeddings"),
        target_layer_ids=ids,
        mask_token_id=mask,
        block_size=_int(_draft_value(cfg, "block_size", 16), "block_size"),
        causal=None if causal is None else bool(causal),
        rope_theta=None if rope_theta is None else float(rope_theta),
        rope_parameters=rope_params,
        partial_rotary_factor=None if prf is None else float(prf),
        attention_value_scale=(None if dcfg.get("attention_value_scale") is None
                               else float(dcfg["attention_value_scale"])),
        conv_kernel_size=conv_k,
        conv_group_size=conv_g,
        selector_rank=sel_rank,
        selector_top_k=sel_top_k,
        output_multiplier=opt_float("output_multiplier"),
        final_logit_softcapping=softcap,
        input_embedding_scale=opt_float("input_embedding_scale"),
        sliding_window=sw,
        sliding_window_pattern=pattern,
        num_target_layers=None if ntl is None else _int(ntl, "num_target_layers"),
        rope_is_neox_style=bool(cfg.get("rope_is_neox_style", True)),
        layer_types=None if layer_types is None else tuple(layer_types),
        hidden_act=str(cfg.get("hidden_act") or "silu"),
        raw=cfg,
    )


def expected_shapes(c: DraftConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape (HF/PyTorch order) that ``dflash/model.py`` builds for ``c``."""
    h, hd = c.hidden_size, c.head_dim
    s: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(c.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(c.num_layers):
        p = f"layers.{i}."
        s[p + "input_layernorm.weight"] = (h,)
        s[p + "post_attention_layernorm.weight"] = (h,)
        s[p + "self_attn.q_proj.weight"] = (c.num_heads * hd, h)
        s[p + "self_attn.k_proj.weight"] = (c.num_kv_heads * hd, h)
        s[p + "self_attn.v_proj.weight"] = (c.num_kv_heads * hd, h)
        s[p + "self_attn.o_proj.weight"] = (h, c.num_heads * hd)
        s[p + "self_attn.q_norm.weight"] = (hd,)
        s[p + "self_attn.k_norm.weight"] = (hd,)
        s[p + "mlp.gate_proj.weight"] = (c.intermediate_size, h)
        s[p + "mlp.up_proj.weight"] = (c.intermediate_size, h)
        s[p + "mlp.down_proj.weight"] = (h, c.intermediate_size)
        if c.version == 2:
            assert c.conv_kernel_size and c.conv_group_size
            proj = (2 * c.conv_kernel_size * (h // c.conv_group_size), h)
            for side in ("attention_conv", "mlp_conv"):
                s[p + side + ".base_kernel"] = (2, c.conv_kernel_size, h)
                s[p + side + ".kernel_projection.weight"] = proj
    if c.version == 2:
        assert c.selector_rank
        s["candidate_selector.hidden_projection.weight"] = (c.selector_rank, h)
        s["candidate_selector.predecessor_codebook"] = (c.vocab_size, c.selector_rank)
        s["candidate_selector.successor_codebook"] = (c.vocab_size, c.selector_rank)
    return s
