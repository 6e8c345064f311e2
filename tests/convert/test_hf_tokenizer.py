"""GGUF tokenizer keys from an HF target folder (convert/hf_tokenizer.py).

Exact values on a hand-written byte-level BPE folder, the pre-tokenizer naming table, the
refusals, and a whole conversion whose HF-folder tokenizer equals the one copied from the SmolLM2
GGUF. Byte-for-byte agreement with upstream's converter on real tokenizers (SmolLM2, Qwen2.5) is
in tests/convert/test_upstream_compat.py::test_hf_target_folder_matches_upstream.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from gguf import GGUFValueType as VT

from checkpoints import make_dflash_checkpoint
from convert import ConversionError, convert_hf_to_gguf
from convert.hf_tokenizer import KNOWN_PRE_TOKENIZERS, hf_tokenizer_fields, pre_tokenizer_name
from convert.target import read_kv

BL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
BL_NO_RE = {**BL, "use_regex": False}
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
            r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_RE = QWEN2_RE.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


@pytest.mark.parametrize("pre,name", [
    (BL, "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BL]}, "smollm"),
    ({"type": "Sequence", "pretokenizers": [_split(QWEN2_RE), BL_NO_RE]}, "qwen2"),
    ({"type": "Sequence", "pretokenizers": [_split(LLAMA3_RE), BL_NO_RE]}, "llama-bpe"),
    # nested sequences flatten to the same steps
    ({"type": "Sequence", "pretokenizers": [{"type": "Sequence", "pretokenizers": [_split(QWEN2_RE)]},
                                            BL_NO_RE]}, "qwen2"),
])
def test_pre_tokenizer_names(pre, name):
    assert pre_tokenizer_name({"pre_tokenizer": pre}) == name


def test_pre_tokenizer_table_covers_the_targets_we_name():
    assert sorted(set(KNOWN_PRE_TOKENIZERS.values())) == ["gpt-2", "gpt-4o", "llama-bpe", "qwen2", "qwen35", "smollm"]


@pytest.mark.parametrize("pre", [
    {"type": "Metaspace", "replacement": "\u2581"},
    {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False}, BL]},
    {"type": "Sequence", "pretokenizers": [_split(QWEN2_RE), BL]},      # byte-level regex on top
    None,
])
def test_unknown_pre_tokenizer_names_the_fix(pre):
    with pytest.raises(ConversionError, match="matches none of the llama.cpp pre-tokenizers.*"
                                              "pass the target's GGUF"):
        pre_tokenizer_name({"pre_tokenizer": pre})


def _write_folder(path: Path, *, model: dict | None = None, pre: dict | None = None,
                  added: list | None = None, tcfg: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tj = {
        "version": "1.0",
        "added_tokens": added if added is not None else [
            {"id": 3, "content": "<|im_end|>", "special": True, "normalized": False},
            {"id": 4, "content": "<tool>", "special": False, "normalized": False},
        ],
        "normalizer": None,
        "pre_tokenizer": pre if pre is not None else BL,
        "decoder": {"type": "ByteLevel"},
        "model": model if model is not None else {
            "type": "BPE", "byte_fallback": False,
            "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
    }
    (path / "tokenizer.json").write_text(json.dumps(tj))
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg if tcfg is not None else {
        "add_bos_token": False, "eos_token": "<|im_end|>", "chat_template": "{{ messages }}"}))
    return path


def test_fields_exact(tmp_path):
    fields = hf_tokenizer_fields(_write_folder(tmp_path / "t"), n_vocab=6)
    got = {f.name: (f.value, f.vtype, f.sub_type) for f in fields}
    assert [f.name for f in fields] == [
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
    assert got["tokenizer.ggml.model"] == ("gpt2", VT.STRING, None)
    assert got["tokenizer.ggml.pre"] == ("gpt-2", VT.STRING, None)
    assert got["tokenizer.ggml.tokens"] == (["a", "b", "ab", "<|im_end|>", "<tool>", "[PAD5]"],
                                            VT.ARRAY, VT.STRING)
    T = gguf.TokenType
    assert got["tokenizer.ggml.token_type"] == ([T.NORMAL, T.NORMAL, T.NORMAL, T.CONTROL,
                                                 T.USER_DEFINED, T.UNUSED], VT.ARRAY, VT.INT32)
    assert got["tokenizer.ggml.merges"] == (["a b"], VT.ARRAY, VT.STRING)
    assert got["tokenizer.ggml.eos_token_id"] == (3, VT.UINT32, None)
    assert got["tokenizer.ggml.add_bos_token"] == (False, VT.BOOL, None)
    assert got["tokenizer.chat_template"] == ("{{ messages }}", VT.STRING, None)


@pytest.mark.parametrize("what,kw,n_vocab,msg", [
    ("sentencepiece", dict(model={"type": "Unigram", "vocab": [["a", 0.0]]}), 6,
     "Unigram tokenizer .* is not the byte-level BPE"),
    ("byte fallback", dict(model={"type": "BPE", "byte_fallback": True, "vocab": {"a": 0}, "merges": []}), 6,
     "byte_fallback=True"),
    ("ids beyond vocab", {}, 4, r"token ids \[4\] are outside the target vocab size 4"),
    ("no merges", dict(model={"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": []}), 6,
     "no BPE merges"),
    ("unknown pre", dict(pre={"type": "Whitespace"}), 6, "matches none"),
    ("added token without id", dict(added=[{"content": "<|x|>", "special": True}]), 6,
     "malformed vocab or added_tokens"),
])
def test_refusals(tmp_path, what, kw, n_vocab, msg):
    folder = _write_folder(tmp_path / "t", **kw)
    with pytest.raises(ConversionError, match=msg):
        hf_tokenizer_fields(folder, n_vocab=n_vocab)


def _smollm2_hf_folder(smollm2_gguf, dest: Path, hidden: int, layers: int) -> Path:
    """An HF target folder whose tokenizer.json is SmolLM2's, written from its GGUF as JSON."""
    kv = read_kv(smollm2_gguf)
    dec = lambda v: v.decode("utf-8")  # noqa: E731
    tokens = [dec(t) for t in kv["tokenizer.ggml.tokens"].value]
    types = kv["tokenizer.ggml.token_type"].value
    added = [{"id": i, "content": t, "special": ty == 3, "normalized": False}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)]
    model = {"type": "BPE", "byte_fallback": False, "vocab": {t: i for i, t in enumerate(tokens)},
             "merges": [dec(m).split(" ", 1) for m in kv["tokenizer.ggml.merges"].value]}
    pre = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BL]}
    name = lambda k: tokens[kv[f"tokenizer.ggml.{k}_token_id"].value]  # noqa: E731
    tcfg = {"add_bos_token": kv["tokenizer.ggml.add_bos_token"].value, "bos_token": name("bos"),
            "eos_token": name("eos"), "unk_token": name("unknown"), "pad_token": name("padding"),
            "chat_template": dec(kv["tokenizer.chat_template"].value)}
    folder = _write_folder(dest, model=model, pre=pre, added=added, tcfg=tcfg)
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "num_hidden_layers": layers,
         "vocab_size": len(tokens)}))
    return folder


def test_conversion_with_hf_target_equals_gguf_target(tmp_path, smollm2_gguf):
    """Same drafter, target given as GGUF or as HF folder: identical tokenizer.* keys (the GGUF's
    own ``add_space_prefix`` flag aside, which HF files do not carry) and identical everything else."""
    ck = make_dflash_checkpoint(tmp_path / "ck", hidden_size=576, intermediate_size=512, num_layers=1,
                                num_heads=9, num_kv_heads=3, target_layer_ids=(1, 14, 27),
                                num_target_layers=30, selector_rank=32)
    hf = _smollm2_hf_folder(smollm2_gguf, tmp_path / "hf", hidden=576, layers=30)
    a = convert_hf_to_gguf(ck, hf, outfile=tmp_path / "from-hf.gguf", outtype="f16")
    b = convert_hf_to_gguf(ck, smollm2_gguf, outfile=tmp_path / "from-gguf.gguf", outtype="f16")
    ka, kb = read_kv(a), read_kv(b)
    assert set(kb) - set(ka) == {"tokenizer.ggml.add_space_prefix"} and set(ka) <= set(kb)
    for k, v in ka.items():
        assert (v.value, v.vtype, v.sub_type) == (kb[k].value, kb[k].vtype, kb[k].sub_type), k
    assert ka["tokenizer.ggml.pre"].value == b"smollm"


def test_not_a_tokenizer_json(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("[1, 2]")
    with pytest.raises(ConversionError, match="not a tokenizers-library tokenizer.json"):
        hf_tokenizer_fields(folder, n_vocab=6)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConversionError, match="cannot read .*tokenizer.json"):
        hf_tokenizer_fields(folder, n_vocab=6)

