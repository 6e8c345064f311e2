"""Our converter against upstream's converter of record, byte for byte.

Upstream = ``convert_hf_to_gguf.py`` of llama.cpp 0c1e570 (vendored by the llama-cpp-python
0.3.36 sdist, class ``DFlashModel`` in ``conversion/qwen.py``), fetched and run in isolation by
``benchmarks/upstream.py``. Both convert the same random checkpoints in the authors' format,
sized for the real SmolLM2-135M target (hidden 576, vocab 49152, 30 layers). Upstream gets an HF
target folder built offline from the SmolLM2 GGUF; ours gets the GGUF itself.

For each case and outtype (f32, f16, bf16, q8_0: all that upstream has) the two files must carry:
- the same ``dflash.*`` keys, value types and values;
- the same ``tokenizer.*`` keys and values, except :data:`ALLOWED_TOKENIZER_ONLY_OURS`;
- ``general.*`` keys that differ only in :data:`ALLOWED_GENERAL_DIFFS` (differences printed);
- the same tensors: names, shapes, ggml types and bytes.

Then both converters get the same HF target folders (SmolLM2 and Qwen2.5-Coder, tokenizers
rebuilt from the real GGUFs with the released tokenizers' pre-tokenizers) and must write identical
files, ``tokenizer.*`` included with no exception: the HF-folder tokenizer path
(:mod:`convert.hf_tokenizer`) against upstream's ``_set_vocab_gpt2``.

Needs the package registry once (then cached), plus torch, transformers, sentencepiece and
tokenizers for upstream's converter. Skips only when the registry cannot be reached.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from benchmarks import upstream as up
from checkpoints import make_dflash_checkpoint
from convert import convert_hf_to_gguf

pytestmark = pytest.mark.slow

#: ``general.*`` keys allowed to differ (missing on one side or different value). Upstream names
#: the model after the checkpoint folder and sizes it from its parameters; so do we. Add a key
#: here only with a reason.
ALLOWED_GENERAL_DIFFS: frozenset[str] = frozenset()

#: ``tokenizer.*`` keys only our file has: we copy the target GGUF's tokenizer keys verbatim, and
#: the SmolLM2 GGUF carries ``add_space_prefix = false``; upstream regenerates the keys from the
#: HF tokenizer files, which have no such flag (llama.cpp's default for gpt2 vocabs is false too,
#: so the two files tokenize alike).
ALLOWED_TOKENIZER_ONLY_OURS: frozenset[str] = frozenset({"tokenizer.ggml.add_space_prefix"})

_SMOL = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
             vocab_size=49152, target_layer_ids=(1, 14, 27), num_target_layers=30, num_layers=2,
             mask_token_id=0)

#: case name -> make_dflash_checkpoint keywords (on top of _SMOL).
CASES: dict[str, dict] = {
    "v1": dict(version=1),
    "v2": dict(version=2),
    # Muse-Glimmer-like extras: SWA on some layers, logit scale, softcap, embedding scale, causal.
    "v2-swa-softcap-scale": dict(version=2, block_size=16, config_overrides={
        "use_sliding_window": True, "sliding_window": 2048,
        "layer_types": ["sliding_attention", "full_attention"], "is_causal": True,
        "dflash_config": {"output_multiplier": 0.196, "final_logit_softcapping": 20.0,
                          "input_embedding_scale": 2.5}}),
    # transformers 5 rope layout (rope_parameters) with yarn scaling, f16 sharded source.
    "v2-rope-parameters-sharded": dict(version=2, dtype="float16", shards=3, config_overrides={
        "rope_theta": None,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                            "original_max_position_embeddings": 8192}}),
    # Interleaved-rope checkpoint (upstream permutes q/k and their norms to NeoX order), partial
    # rotary (rope.dimension_count) and an attention value scale.
    "v2-interleaved-partial-rope": dict(version=2, config_overrides={
        "rope_is_neox_style": False, "rope_theta": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "partial_rotary_factor": 0.5},
        "dflash_config": {"attention_value_scale": 0.5}}),
    # v1 with f32 storage and the whole-drafter SWA switch the authors put in dflash_config.
    "v1-f32-use-swa": dict(version=1, dtype="float32", config_overrides={
        "dflash_config": {"use_swa": True, "swa_window_size": 1024}}),
}
_FULL = ("f32", "f16", "bf16", "q8_0")
PAIRS = [(c, o) for c in ("v1", "v2") for o in _FULL] + [
    ("v2-swa-softcap-scale", "q8_0"), ("v2-rope-parameters-sharded", "bf16"),
    ("v2-interleaved-partial-rope", "f16"), ("v1-f32-use-swa", "f16"),
]


@pytest.fixture(scope="session")
def upstream_dir() -> Path:
    """Upstream's converter folder (fetched once); skips if the registry is unreachable."""
    try:
        return up.fetch_upstream()
    except up.UpstreamUnavailable as e:
        pytest.skip(f"upstream converter unavailable (package registry unreachable?): {e}")


@pytest.fixture(scope="session")
def hf_target(smollm2_gguf) -> Path:
    """HF target folder (config + tokenizer) for upstream, built offline from the SmolLM2 GGUF."""
    return up.hf_target_from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Random checkpoints of every case (written once per session)."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_dflash_checkpoint(root / name, **{**_SMOL, **kw}) for name, kw in CASES.items()}


def _fields(reader: GGUFReader) -> dict[str, tuple[tuple[str, ...], object]]:
    """Key -> (value type names, value) for every metadata key but the GGUF header's."""
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = (tuple(t.name for t in f.types), f.contents())
    return out


def _short(v: object) -> str:
    s = repr(v)
    return s if len(s) < 120 else s[:117] + "..."


def _diff(ours: dict, theirs: dict, prefix: str) -> dict[str, tuple[object, object]]:
    """Keys under ``prefix`` whose (types, value) differ; missing side is None."""
    keys = {k for k in (*ours, *theirs) if k.startswith(prefix)}
    return {k: (ours.get(k), theirs.get(k)) for k in sorted(keys) if ours.get(k) != theirs.get(k)}


@pytest.mark.parametrize("case,outtype", PAIRS, ids=[f"{c}-{o}" for c, o in PAIRS])
def test_matches_upstream(case, outtype, checkpoints, hf_target, upstream_dir, smollm2_gguf,
                          tmp_path):
    """Ours (target GGUF) and upstream (HF target folder) write the same keys and tensors."""
    src = checkpoints[case]
    theirs_path = up.run_upstream_converter(src, hf_target, tmp_path / "upstream.gguf",
                                            outtype=outtype, timeout=600)
    ours_path = convert_hf_to_gguf(src, smollm2_gguf, outfile=tmp_path / "ours.gguf",
                                   outtype=outtype)
    _assert_same_file(ours_path, theirs_path, f"{case}-{outtype}", ALLOWED_TOKENIZER_ONLY_OURS)


_QWEN = dict(hidden_size=896, intermediate_size=4864, num_heads=14, num_kv_heads=2, head_dim=64,
             vocab_size=151936, target_layer_ids=(1, 12, 22), num_target_layers=24, num_layers=1,
             mask_token_id=151665, selector_rank=32)

#: HF target folders (rebuilt offline from the real GGUFs with the released tokenizers'
#: pre-tokenizers) -> (GGUF fixture, drafter shape).
HF_TARGETS = {"smollm2": ("smollm2_gguf", _SMOL), "qwen2.5-coder": ("qwen25_05b_gguf", _QWEN)}


@pytest.mark.parametrize("name", sorted(HF_TARGETS))
def test_hf_target_folder_matches_upstream(name, request, upstream_dir, tmp_path):
    """Both converters given the same HF target folder write identical files, tokenizer included
    (upstream names ``tokenizer.ggml.pre`` by hashing token ids, ours from the split rules)."""
    fixture, shape = HF_TARGETS[name]
    hf = up.hf_target_from_gguf(request.getfixturevalue(fixture))
    src = make_dflash_checkpoint(tmp_path / "ck", version=2, **shape)
    theirs_path = up.run_upstream_converter(src, hf, tmp_path / "upstream.gguf", outtype="f16",
                                            timeout=600)
    ours_path = convert_hf_to_gguf(src, hf, outfile=tmp_path / "ours.gguf", outtype="f16")
    _assert_same_file(ours_path, theirs_path, f"hf-{name}", frozenset())


def _assert_same_file(ours_path: Path, theirs_path: Path, label: str,
                      tokenizer_only_ours: frozenset[str]) -> None:
    """Same dflash.* and tokenizer.* keys (but ``tokenizer_only_ours``), allowed general.* diffs,
    no other keys, the same tensors (names, types, shapes, bytes)."""
    ours_r, theirs_r = GGUFReader(ours_path), GGUFReader(theirs_path)
    ours, theirs = _fields(ours_r), _fields(theirs_r)

    assert ours["general.architecture"][1] == theirs["general.architecture"][1] == "dflash"

    general = _diff(ours, theirs, "general.")
    for k, (a, b) in general.items():
        print(f"[{label}] general differs: {k}: ours={_short(a)} upstream={_short(b)}")
    assert set(general) <= ALLOWED_GENERAL_DIFFS, f"new general.* differences: {sorted(set(general) - ALLOWED_GENERAL_DIFFS)}"

    dflash = _diff(ours, theirs, "dflash.")
    assert not dflash, "dflash.* keys differ (ours, upstream):\n" + "\n".join(
        f"  {k}: {_short(a)} | {_short(b)}" for k, (a, b) in dflash.items())

    tok = _diff(ours, theirs, "tokenizer.")
    for k, (a, b) in tok.items():
        print(f"[{label}] tokenizer differs: {k}: ours={_short(a)} upstream={_short(b)}")
    unexpected = {k: v for k, v in tok.items()
                  if not (k in tokenizer_only_ours and v[1] is None)}
    assert not unexpected, "tokenizer.* keys differ (ours, upstream):\n" + "\n".join(
        f"  {k}: {_short(a)} | {_short(b)}" for k, (a, b) in unexpected.items())

    others = {k for k in (*ours, *theirs) if not k.startswith(("general.", "dflash.", "tokenizer."))}
    assert not others, f"keys outside general./dflash./tokenizer.: {sorted(others)}"

    ot = {t.name: t for t in ours_r.tensors}
    tt = {t.name: t for t in theirs_r.tensors}
    assert sorted(ot) == sorted(tt), (f"tensor names: only ours {sorted(set(ot) - set(tt))}, "
                                      f"only upstream {sorted(set(tt) - set(ot))}")
    bad = []
    for name, a in ot.items():
        b = tt[name]
        if a.tensor_type != b.tensor_type or list(a.shape) != list(b.shape):
            bad.append(f"{name}: ours {a.tensor_type.name}{list(a.shape)} "
                       f"upstream {b.tensor_type.name}{list(b.shape)}")
        elif not np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)):
            bad.append(f"{name}: {a.tensor_type.name} bytes differ")
    assert not bad, "tensors differ:\n  " + "\n  ".join(bad)
    if [t.name for t in ours_r.tensors] != [t.name for t in theirs_r.tensors]:
        print(f"[{label}] tensor order differs (same set)")


#: Target architectures whose upstream vocab handler reads a SentencePiece ``tokenizer.model``
#: (conversion/llama.py LlamaModel, qwen.py Qwen2Model, gemma.py GemmaModel .. Gemma3Model).
SPM_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
             "Gemma3ForCausalLM")


@pytest.mark.parametrize("arch", SPM_ARCHS + ("LlamaForCausalLM+tokenizer.json", "Gemma4ForCausalLM+tokenizer.json"))
def test_sentencepiece_target_matches_upstream(arch, upstream_dir, tmp_path):
    """An HF target folder with a SentencePiece ``tokenizer.model`` (trained in-test, byte fallback,
    added tokens past the model's pieces, padding): both converters write identical files,
    ``tokenizer.*`` included (ours: :mod:`convert.target_vocab`; upstream: the target class's
    ``set_vocab``, reached through ``DFlashModel.set_vocab``). ``ARCH+tokenizer.json``: a
    SentencePiece-converted ``tokenizer.json`` and no ``tokenizer.model`` (gguf-py's
    ``LlamaHfVocab``: Llama 2 / Mistral-style releases, Gemma 4)."""
    pytest.importorskip("sentencepiece")
    from hub_cache import llama_hf_target, sentencepiece_target

    if arch.endswith("+tokenizer.json"):
        pytest.importorskip("transformers")
        files, n_vocab = llama_hf_target(arch=arch.split("+")[0], hidden=288, n_layer=4)
    else:
        files, n_vocab = sentencepiece_target(arch=arch, hidden=288, n_layer=4)
    target = tmp_path / "target"
    target.mkdir()
    for name, data in files.items():
        (target / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    src = make_dflash_checkpoint(tmp_path / "ck", version=2, hidden_size=288, intermediate_size=576, num_layers=1,
                                 num_heads=4, num_kv_heads=2, head_dim=72, vocab_size=n_vocab,
                                 target_layer_ids=(0, 2), num_target_layers=4, mask_token_id=2,
                                 dtype="float32", selector_rank=32)
    theirs_path = up.run_upstream_converter(src, target, tmp_path / "upstream.gguf", outtype="f16", timeout=600)
    ours_path = convert_hf_to_gguf(src, target, outfile=tmp_path / "ours.gguf", outtype="f16")
    _assert_same_file(ours_path, theirs_path, f"spm-{arch}", frozenset())
    tok = _fields(GGUFReader(ours_path))
    model = "gemma4" if arch.startswith("Gemma4") else "llama"
    # LlamaHfVocab lists the tokenizer's own ids only (no padding up to vocab_size), upstream too
    n_tokens = n_vocab - 1 if arch.endswith("+tokenizer.json") else n_vocab
    assert tok["tokenizer.ggml.model"][1] == model
    assert len(tok["tokenizer.ggml.scores"][1]) == len(tok["tokenizer.ggml.tokens"][1]) == n_tokens
