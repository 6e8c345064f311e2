"""Convert a DFlash (v1) / DFlash 2 (v2) drafter from the authors' HF format to GGUF.

Output follows upstream's ``dflash`` schema (llama.cpp 0c1e570, ``conversion/qwen.py`` class
``DFlashModel`` on top of ``TextModel.set_gguf_parameters``): same keys, value types, tensor
names, shapes and dtypes. The tokenizer is copied from the target's GGUF.

Tensor dtype policy (upstream ``ModelBase.prepare_tensors`` for f32/f16/bf16/q8_0):

* 1-D tensors and ``*_norm.weight`` (all RMSNorm weights: ``blk.N.attn_norm``, ``ffn_norm``,
  ``attn_q_norm``, ``attn_k_norm``, ``enc.output_norm``, ``output_norm``): always F32.
* Conv base kernels (``blk.N.attn_conv_base``, ``blk.N.ffn_conv_base``, [2, K, hidden]): their
  names do not end in ``.weight``, so upstream stores them F32 for every outtype; so do we
  (``llama_model_quantize`` also leaves them alone).
* Every other matrix takes the requested type: ``fc.weight`` (the [hidden, n_ids*hidden]
  context projection), attention / MLP projections, the conv kernel projections
  (``blk.N.{attn,ffn}_conv_proj.weight``), the selector's ``selector_hidden.weight`` and both
  codebooks ``selector_{predecessor,successor}.weight`` ([vocab, rank]).
* q8_0 / q4_0 use ``gguf.quants``; a matrix whose row length is not a multiple of the block
  size (32) falls back to F16 with a warning, as upstream does on ``QuantError``.
* K-quants (q4_k_m, q5_k_m, q6_k): an F32 GGUF is written to a temp file, then libllama's
  ``llama_model_quantize`` (through ``llama_cpp.llama_cpp``, imported only then) picks the
  per-tensor types exactly as ``llama-quantize`` would. Rows not divisible by 256 make
  llama.cpp fall back (Q5_0 / Q5_1 / Q8_0 / F16); those tensors are logged before quantizing.

q4_0 and the K-quants are not upstream converter outtypes (they come from ``llama-quantize``);
``general.file_type`` is set to the matching ``LlamaFileType``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import LlamaFileType as FT

from .config import DraftConfig, expected_shapes, parse_config
from .errors import ConversionError
from .hub import fetch_snapshot, is_hub_id, resolve_target
from .names import ARCH, KEYS, TARGET_LAYER_OFFSET, TensorRule, map_tensor_name
from .safetensors_io import TensorEntry, index_checkpoint, read_tensor
from .target import KV, Target, check_pairing, load_target

__all__ = ["convert_hf_to_gguf", "OUTTYPES", "plan_tensor_type"]

logger = logging.getLogger("convert")

#: outtype -> (file type written to general.file_type, matrix type, K-quant llama_ftype or None)
OUTTYPES: dict[str, tuple[FT, QT, int | None]] = {
    "f32": (FT.ALL_F32, QT.F32, None),
    "f16": (FT.MOSTLY_F16, QT.F16, None),
    "bf16": (FT.MOSTLY_BF16, QT.BF16, None),
    "q8_0": (FT.MOSTLY_Q8_0, QT.Q8_0, None),
    "q4_0": (FT.MOSTLY_Q4_0, QT.Q4_0, None),
    "q4_k_m": (FT.MOSTLY_Q4_K_M, QT.F32, 15),   # LLAMA_FTYPE_MOSTLY_Q4_K_M
    "q5_k_m": (FT.MOSTLY_Q5_K_M, QT.F32, 17),   # LLAMA_FTYPE_MOSTLY_Q5_K_M
    "q6_k": (FT.MOSTLY_Q6_K, QT.F32, 18),       # LLAMA_FTYPE_MOSTLY_Q6_K
}

@dataclass(frozen=True)
class _Planned:
    entry: TensorEntry
    gguf_name: str
    rule: TensorRule
    qtype: QT
    nbytes: int


def plan_tensor_type(gguf_name: str, kind: str, shape: tuple[int, ...], matrix_type: QT) -> QT:
    """GGUF dtype of one tensor for a matrix type (upstream's rule, see module docstring).

    ``shape`` is in HF (row-major) order; the quantization blocks run along ``shape[-1]``.
    """
    if len(shape) <= 1 or kind in ("norm", "base") or gguf_name.endswith("_norm.weight") \
            or not gguf_name.endswith(".weight"):
        return QT.F32
    block = gguf.GGML_QUANT_SIZES[matrix_type][0]
    if shape[-1] % block:
        logger.warning("%s: row length %d is not a multiple of %s's block size %d, falling back to F16",
                       gguf_name, shape[-1], matrix_type.name, block)
        return QT.F16
    return matrix_type


_ROPE_PERMUTE_SUFFIXES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def to_neox_layout(data: np.ndarray, head_dim: int) -> np.ndarray:
    """Interleaved-RoPE rows -> NeoX layout (per head: even dims first, then odd dims).

    For checkpoints with ``rope_is_neox_style: false``; applied to q/k projections (rows) and
    q/k norms, as upstream's ``DFlashModel.modify_tensors`` does.
    """
    shape = data.shape
    return np.ascontiguousarray(
        np.swapaxes(data.reshape(-1, head_dim // 2, 2, *shape[1:]), 1, 2)).reshape(shape)


def _nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


def _resolve_source(src: str | Path) -> tuple[Path, str | None]:
    """Local folder, or hub id fetched with ``snapshot_download`` -> (folder, hub id or None)."""
    p = Path(src).expanduser()
    if p.is_dir():
        return p, None
    if p.exists():
        raise ConversionError(f"source {str(src)!r} is a file; pass the checkpoint folder")
    s = str(src)
    if not is_hub_id(s):
        raise ConversionError(f"source {s!r}: no such folder (and not a Hugging Face hub id)")
    folder = fetch_snapshot(s, ["*.json", "*.safetensors", "*.md"],
                            fix="download it yourself and pass the local folder instead")
    return folder, s


def _plan_tensors(cfg: DraftConfig, entries: list[TensorEntry], matrix_type: QT) -> list[_Planned]:
    """Check names and shapes against ``cfg`` and decide each tensor's GGUF dtype."""
    want = expected_shapes(cfg)
    have = {e.name: e for e in entries}
    missing = [n for n in want if n not in have]
    unexpected = [n for n in have if n not in want]
    misshaped = [f"{n} {list(have[n].shape)} (expected {list(want[n])})"
                 for n in want if n in have and tuple(have[n].shape) != want[n]]
    problems = []
    if missing:
        problems.append("missing tensors: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected tensors: " + ", ".join(unexpected))
    if misshaped:
        problems.append("misshaped tensors: " + ", ".join(misshaped))
    if problems:
        raise ConversionError(f"checkpoint does not match its config ({cfg.architecture}, "
                              f"{cfg.num_layers} layers): " + "; ".join(problems))
    plan = []
    for e in entries:
        mapped = map_tensor_name(e.name)
        if mapped is None:  # expected_shapes and the table disagree: a bug of ours
            raise ConversionError(f"no GGUF name for tensor {e.name!r}")
        name, rule = mapped
        qtype = plan_tensor_type(name, rule.kind, e.shape, matrix_type)
        plan.append(_Planned(e, name, rule, qtype, _nbytes(e.shape, qtype)))
    return plan


def _add(w: gguf.GGUFWriter, alias: str, value) -> None:
    k = KEYS[alias]
    w.add_key_value(k.name(ARCH), value, k.vtype, k.sub_type)


def _write_params(w: gguf.GGUFWriter, cfg: DraftConfig, file_type: FT, target: Target) -> None:
    """``TextModel.set_gguf_parameters`` + ``DFlashModel.set_gguf_parameters``, in that order."""
    _add(w, "block_count", cfg.num_layers)
    if cfg.context_length is not None:
        _add(w, "context_length", cfg.context_length)
    _add(w, "embedding_length", cfg.hidden_size)
    _add(w, "feed_forward_length", cfg.intermediate_size)
    _add(w, "head_count", cfg.num_heads)
    _add(w, "head_count_kv", cfg.num_kv_heads)
    if cfg.causal is False:
        _add(w, "causal", False)
    rp = cfg.rope_parameters
    rope_type, factor = rp.get("rope_type"), rp.get("factor")
    if rope_type == "linear" and factor is not None:
        _add(w, "rope_scaling_type", "linear")
        _add(w, "rope_scaling_factor", float(factor))
    elif rope_type == "yarn" and factor is not None:
        _add(w, "rope_scaling_type", "yarn")
        _add(w, "rope_scaling_factor", float(factor))
        if "original_max_position_embeddings" not in rp:
            raise ConversionError("yarn rope scaling needs original_max_position_embeddings")
        _add(w, "rope_scaling_orig_ctx_len", int(rp["original_max_position_embeddings"]))
        for alias, names in (("rope_yarn_ext_factor", ("extrapolation_factor",)),
                             ("rope_yarn_attn_factor", ("attention_factor", "attn_factor")),
                             ("rope_yarn_beta_fast", ("beta_fast",)),
                             ("rope_yarn_beta_slow", ("beta_slow",))):
            v = next((rp[n] for n in names if rp.get(n) is not None), None)
            if v is not None:
                _add(w, alias, float(v))
    elif rope_type in ("su", "longrope"):
        _add(w, "rope_scaling_type", "longrope")
    elif rope_type not in (None, "default", "dynamic", "llama3", "Llama3", "LLAMA3"):
        logger.warning("unknown RoPE type %r: no rope scaling keys written (as upstream)", rope_type)
    if cfg.rope_theta is not None:
        _add(w, "rope_freq_base", cfg.rope_theta)
    else:
        logger.warning("config.json has no rope_theta: llama.cpp will use its default")
    if cfg.rms_norm_eps is not None:
        _add(w, "layer_norm_rms_eps", cfg.rms_norm_eps)
    if cfg.head_dim_explicit:
        _add(w, "key_length", cfg.head_dim)
        _add(w, "value_length", cfg.head_dim)
    _add(w, "file_type", int(file_type))

    # DFlashModel.set_gguf_parameters
    if cfg.partial_rotary_factor is not None:
        _add(w, "rope_dimension_count", int(cfg.head_dim * cfg.partial_rotary_factor))
    if cfg.attention_value_scale is not None:
        _add(w, "value_scale", cfg.attention_value_scale)
    _add(w, "block_size", cfg.block_size)
    if cfg.version == 2:
        _add(w, "conv_kernel_size", cfg.conv_kernel_size)
        _add(w, "conv_group_size", cfg.conv_group_size)
        _add(w, "selector_rank", cfg.selector_rank)
        _add(w, "selector_top_k", cfg.selector_top_k)
    if cfg.output_multiplier is not None:
        _add(w, "logit_scale", cfg.output_multiplier)
    if cfg.final_logit_softcapping is not None:
        _add(w, "final_logit_softcapping", cfg.final_logit_softcapping)
    if cfg.input_embedding_scale is not None:
        _add(w, "embedding_scale", cfg.input_embedding_scale)
    _add(w, "target_layers", [i + TARGET_LAYER_OFFSET for i in cfg.target_layer_ids])
    if cfg.sliding_window is not None:
        _add(w, "sliding_window", cfg.sliding_window)
        if cfg.sliding_window_pattern:  # upstream's add_array drops an empty list
            _add(w, "sliding_window_pattern", list(cfg.sliding_window_pattern))
    if cfg.causal:  # False was already written above, at the position upstream's dict keeps
        _add(w, "causal", True)
    if target.uses_mrope:
        _add(w, "rope_dimension_sections", [cfg.head_dim // 2, 0, 0, 0])


def _write_metadata(w: gguf.GGUFWriter, src: Path, hub_id: str | None) -> None:
    """``ModelBase.prepare_metadata``: general.type, the model card keys (gguf.Metadata)."""
    total, shared, expert, n_expert = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, src, None, total)
    if hub_id:
        meta.name = hub_id
    if meta.name is None:
        meta.name = src.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, n_expert)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)


def _default_outfile(src: Path, hub_id: str | None, outtype: str) -> Path:
    base = hub_id.split("/")[-1] if hub_id else src.name
    folder = Path.cwd() if hub_id else src
    return folder / f"{base}-{outtype.upper()}.gguf"


def _write_gguf(path: Path, cfg: DraftConfig, plan: list[_Planned], file_type: FT, target: Target,
                tokenizer: list[KV], src: Path, hub_id: str | None) -> None:
    """Write infos first (all shapes known), then stream tensor data in the same order."""
    from tqdm import tqdm

    w = gguf.GGUFWriter(path=None, arch=ARCH)
    for p in plan:
        w.add_tensor_info(p.gguf_name, p.entry.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    _write_metadata(w, src, hub_id)
    _write_params(w, cfg, file_type, target)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for kv in tokenizer:
        w.add_key_value(kv.name, kv.value, kv.vtype, kv.sub_type)
    _add(w, "mask_token_id", cfg.mask_token_id)

    w.write_header_to_file(path=path)
    try:
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(p.nbytes for p in plan)
        with tqdm(total=total, unit="B", unit_scale=True, desc="writing", leave=False,
                  disable=not logger.isEnabledFor(logging.INFO)) as bar:
            for p in plan:
                data = read_tensor(p.entry)
                if not cfg.rope_is_neox_style and p.entry.name.endswith(_ROPE_PERMUTE_SUFFIXES):
                    data = to_neox_layout(data, cfg.head_dim)
                q = gguf.quants.quantize(data, p.qtype)
                del data
                logger.info("%-36s %s -> %s, shape = {%s}", p.gguf_name, p.entry.dtype, p.qtype.name,
                            ", ".join(str(n) for n in reversed(p.entry.shape)))
                w.write_tensor_data(q)
                bar.update(p.nbytes)
                del q
    finally:
        w.close()


def _k_quantize(src: Path, dst: Path, llama_ftype: int, plan: list[_Planned]) -> None:
    """Run libllama's ``llama_model_quantize`` (lazy import of llama_cpp)."""
    for p in plan:
        if p.qtype == QT.F32 and p.rule.kind == "matrix" and p.entry.shape[-1] % 256:
            logger.warning("%s: row length %d is not a multiple of 256; llama.cpp falls back to a "
                           "non-K type for it", p.gguf_name, p.entry.shape[-1])
    try:
        from llama_cpp import llama_cpp as ll
    except Exception as e:  # noqa: BLE001
        raise ConversionError(f"K-quant outtypes need llama-cpp-python's libllama ({e})") from None
    params = ll.llama_model_quantize_default_params()
    params.ftype = llama_ftype
    params.nthread = max(1, min(os.cpu_count() or 1, 8))
    rc = ll.llama_model_quantize(str(src).encode(), str(dst).encode(), ll.byref(params))
    if rc != 0:
        raise ConversionError(f"llama_model_quantize failed with code {rc}")


def convert_hf_to_gguf(src, target=None, outfile=None, outtype: str = "f16", force: bool = False) -> Path:
    """Convert a DFlash / DFlash 2 drafter checkpoint to a GGUF for llama.cpp's ``dflash`` arch.

    Args:
        src: Checkpoint folder (``config.json`` + ``model.safetensors`` or shards with
            ``model.safetensors.index.json``; BF16/F16/F32 tensors) or a Hugging Face hub id,
            fetched with ``huggingface_hub.snapshot_download`` (honours ``HF_HUB_OFFLINE`` and
            the hub cache).
        target: The target's GGUF (sizes checked, whole tokenizer copied), or an HF target
            folder (sizes from ``config.json``; tokenizer keys built as llama.cpp's converter
            builds them for the target's architecture, :mod:`convert.target_vocab`), or a hub
            id ``org/name`` (only config.json and tokenizer files fetched), or a hub GGUF
            ``org/name:QUANT`` (that one file fetched). None: the target the drafter names in
            its config.json or model card (``base_model``), fetched as a hub id. The choice is
            logged on the ``convert.target`` logger (:mod:`convert.hub`).
        outfile: Output path; default ``<src>/<src name>-<OUTTYPE>.gguf`` (hub ids: current
            folder).
        outtype: ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``, ``q4_k_m``, ``q5_k_m``, ``q6_k``.
        force: Overwrite an existing output file.

    Returns:
        The output path. The file appears atomically (temp file in the output folder, then
        ``os.replace``); on any error nothing is left behind.

    Raises:
        ConversionError: unknown architecture / outtype, missing config keys, missing,
            unexpected or misshaped tensors (listed by name), truncated safetensors, drafter and
            target mismatch (hidden size, vocab, mask token, target layer ids beyond the
            target's depth), conv group size not dividing the hidden size, DFlash 2 hidden size
            below ``top_k*(top_k+1)``, an existing output without ``force``, an unreachable hub
            (offline and not cached: the message names what to pass), a drafter that names no
            target (or several) when ``target`` is None, a target tokenizer kind not built here.

    Upstream: ``conversion/qwen.py`` class ``DFlashModel`` (llama.cpp 0c1e570).
    """
    outtype = str(outtype).lower()
    if outtype not in OUTTYPES:
        raise ConversionError(f"unknown outtype {outtype!r}; choose one of {', '.join(OUTTYPES)}")
    file_type, matrix_type, llama_ftype = OUTTYPES[outtype]

    folder, hub_id = _resolve_source(src)
    cfg = parse_config(folder)
    if (folder / "mask_embedding.pt").is_file():
        raise ConversionError(
            "mask_embedding.pt found: drafters that patch the target's token embeddings (MiMo) "
            "need the target's HF weights and are not supported; use upstream's converter")
    # the output is checked before the target is fetched (a hub GGUF can be large)
    out = Path(outfile).expanduser() if outfile is not None else _default_outfile(folder, hub_id, outtype)
    if out.is_dir():
        raise ConversionError(f"output {out} is a folder; pass a file path")
    if out.exists() and not force:
        raise ConversionError(f"output {out} exists; pass force=True (--force) to overwrite")
    if not out.parent.is_dir():
        raise ConversionError(f"output folder {out.parent} does not exist")
    choice = resolve_target(target, drafter_folder=folder, drafter_config=cfg.raw)
    tgt = load_target(choice.path)
    reasons = check_pairing(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                            target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id,
                            target=tgt)
    if reasons:
        raise ConversionError(f"drafter does not fit target {choice.spec}: " + "; ".join(reasons))
    if cfg.num_target_layers is not None and cfg.num_target_layers != tgt.n_layer:
        logger.warning("config num_target_layers %d != target block count %d",
                       cfg.num_target_layers, tgt.n_layer)
    tokenizer = tgt.tokenizer_fields()
    plan = _plan_tensors(cfg, index_checkpoint(folder), matrix_type)

    tmp_paths: list[Path] = []
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        os.close(fd)
        tmp_paths.append(Path(tmp))
        _write_gguf(Path(tmp), cfg, plan, file_type, tgt, tokenizer, folder, hub_id)
        if llama_ftype is not None:
            fd, tmp2 = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".q.tmp", dir=out.parent)
            os.close(fd)
            tmp_paths.append(Path(tmp2))
            _k_quantize(Path(tmp), Path(tmp2), llama_ftype, plan)
            tmp = tmp2
        # mkstemp creates 0600; the output gets the usual mode of a new file (0666 & ~umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    finally:
        for t in tmp_paths:
            try:
                t.unlink()
            except FileNotFoundError:
                pass
    logger.info("wrote %s (%s, %d tensors)", out, outtype, len(plan))
    return out
