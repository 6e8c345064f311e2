"""``python -m convert hf-to-gguf org/drafter`` with no ``--target``, offline, from a hub cache.

A hub cache laid out as huggingface_hub lays it out (``tests/hub_cache.py``: blobs, refs/main,
snapshot symlinks) is pointed to with ``HF_HUB_CACHE`` and used with ``HF_HUB_OFFLINE=1``. It
holds random drafters in the authors' format whose model cards name their targets, tiny HF targets
(config.json + tokenizer files only: byte-level BPE and SentencePiece), and a GGUF repository of
the SentencePiece target. The verbatim commands run in a subprocess, as a user runs them.
Byte-for-byte agreement of the SentencePiece tokenizer keys with llama.cpp's own converter is in
tests/convert/test_upstream_compat.py::test_sentencepiece_target_matches_upstream.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("sentencepiece")
pytest.importorskip("huggingface_hub")

from checkpoints import make_dflash_checkpoint  # noqa: E402
from hub_cache import CHAT_TEMPLATE, add_repo, bpe_target_files, sentencepiece_target  # noqa: E402
from tiny_models import write_tiny_target  # noqa: E402

from convert import ConversionError  # noqa: E402
from convert.hub import parse_hub_gguf, pick_gguf, target_from_drafter  # noqa: E402
from convert.target import read_kv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HIDDEN, LAYERS, IDS, MASK = 288, 4, (0, 2), 3


def _card(base_model) -> str:
    lines = ["---", "library_name: transformers", "tags:", "- dflash", "- speculative-decoding"]
    if isinstance(base_model, list):
        lines += ["base_model:"] + [f"- {b}" for b in base_model]
    elif base_model is not None:
        lines.append(f"base_model: {base_model}")
    return "\n".join(lines + ["---", "", "# A DFlash 2 drafter", ""])


def _drafter_files(tmp: Path, n_vocab: int, *, card=None, config_overrides=None, seed=0) -> dict[str, bytes]:
    ck = make_dflash_checkpoint(tmp, version=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_layers=1,
                                num_heads=4, num_kv_heads=2, head_dim=HIDDEN // 4, vocab_size=n_vocab,
                                target_layer_ids=IDS, num_target_layers=LAYERS, block_size=6,
                                mask_token_id=MASK, dtype="bfloat16", seed=seed, selector_rank=32,
                                config_overrides=config_overrides)
    files = {p.name: p.read_bytes() for p in ck.iterdir()}
    if card is not None:
        files["README.md"] = _card(card).encode()
    return files


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A hub cache: {"cache": path, "spm_gguf": the SentencePiece target's GGUF, "n_spm": vocab,
    "n_bpe": vocab}. Repositories (org ``tiny-org``):

    - ``Tiny-BPE-Target`` / ``Tiny-SPM-Target``: config.json + tokenizer files (no weights);
    - ``Tiny-SPM-Target-GGUF``: ``Tiny-SPM-Target-Q4_K_M.gguf`` (a real tiny F32 model under that
      name) and a decoy ``Tiny-SPM-Target-Q8_0.gguf`` that is no GGUF at all;
    - ``Tiny-DFlash2`` (card base_model: the BPE target), ``Tiny-SPM-DFlash2`` (card: the SPM
      target, as a list), ``Tiny-Orphan-DFlash2`` (card: ``tiny-org/Missing-Target``, not cached),
      ``Tiny-Cfg-DFlash2`` (config.json ``dflash_config.target_model`` = the SPM target; card: the
      BPE one, which the config field overrides).
    """
    root = tmp_path_factory.mktemp("hub")
    cache = root / "hub-cache"
    spm_files, n_spm = sentencepiece_target(hidden=HIDDEN, n_layer=LAYERS)
    bpe_files, n_bpe = bpe_target_files(hidden=HIDDEN, n_layer=LAYERS)
    spm_snap = add_repo(cache, "tiny-org/Tiny-SPM-Target", spm_files)
    add_repo(cache, "tiny-org/Tiny-BPE-Target", bpe_files)

    from convert.target_vocab import target_vocab_fields

    gguf_path = write_tiny_target(root / "Tiny-SPM-Target-Q4_K_M.gguf", hidden=HIDDEN, n_layer=LAYERS,
                                  vocab=target_vocab_fields(spm_snap, n_spm, "LlamaForCausalLM"))
    add_repo(cache, "tiny-org/Tiny-SPM-Target-GGUF", {
        "Tiny-SPM-Target-Q4_K_M.gguf": gguf_path.read_bytes(),
        "Tiny-SPM-Target-Q8_0.gguf": b"not a gguf",
        "README.md": _card("tiny-org/Tiny-SPM-Target")})

    add_repo(cache, "tiny-org/Tiny-DFlash2", _drafter_files(root / "d1", n_bpe, card="tiny-org/Tiny-BPE-Target"))
    add_repo(cache, "tiny-org/Tiny-SPM-DFlash2",
             _drafter_files(root / "d2", n_spm, card=["tiny-org/Tiny-SPM-Target"], seed=1))
    add_repo(cache, "tiny-org/Tiny-Orphan-DFlash2",
             _drafter_files(root / "d3", n_spm, card="tiny-org/Missing-Target", seed=2))
    add_repo(cache, "tiny-org/Tiny-Cfg-DFlash2",
             _drafter_files(root / "d4", n_spm, card="tiny-org/Tiny-BPE-Target", seed=3,
                            config_overrides={"dflash_config": {"target_model": "tiny-org/Tiny-SPM-Target"}}))
    return {"cache": cache, "spm_gguf": gguf_path, "n_spm": n_spm, "n_bpe": n_bpe, "spm_files": spm_files,
            "bpe_files": bpe_files}


def _run(hub, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m convert ARGS`` in ``cwd``, offline, on the test's hub cache only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HUB_CACHE=str(hub["cache"]), HF_HOME=str(hub["cache"].parent / "hf-home"),
               HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO), OMP_WAIT_POLICY="passive")
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "convert", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _tok(path) -> dict:
    return {k: (v.value, v.vtype, v.sub_type) for k, v in read_kv(path).items() if k.startswith("tokenizer.")}


def test_verbatim_command_bpe_target(hub, tmp_path):
    """No --target: the card's base_model (a hub id) is the target; its tokenizer.json is converted."""
    proc = _run(hub, tmp_path / "work", "hf-to-gguf", "tiny-org/Tiny-DFlash2")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "work" / "Tiny-DFlash2-F16.gguf"
    assert proc.stdout.strip() == str(out)
    assert "target: tiny-org/Tiny-BPE-Target (from model card base_model)" in proc.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]

    from tokenizers import Tokenizer

    tj = Tokenizer.from_str(hub["bpe_files"]["tokenizer.json"])
    kv = _tok(out)
    tokens = [t.decode() for t in kv["tokenizer.ggml.tokens"][0]]
    assert len(tokens) == hub["n_bpe"]
    # two ids past the tokenizer's own: padding, as upstream pads to the vocab size
    assert tokens == [tj.id_to_token(i) for i in range(hub["n_bpe"] - 2)] + [f"[PAD{hub['n_bpe'] - 2}]",
                                                                            f"[PAD{hub['n_bpe'] - 1}]"]
    assert kv["tokenizer.ggml.token_type"][0][-4:] == [3, 3, 5, 5]  # <|im_start|> <|im_end|> CONTROL, PAD UNUSED
    assert kv["tokenizer.ggml.model"][0] == b"gpt2" and kv["tokenizer.ggml.pre"][0] == b"qwen2"
    assert [m.decode() for m in kv["tokenizer.ggml.merges"][0]] == ["t h", "th e", "Ġ the", "e r"]
    assert kv["tokenizer.ggml.eos_token_id"][0] == tj.token_to_id("<|im_end|>")
    assert kv["tokenizer.chat_template"][0] == CHAT_TEMPLATE.encode()
    assert kv["tokenizer.ggml.mask_token_id"][0] == MASK
    assert read_kv(out)["general.name"].value == b"tiny-org/Tiny-DFlash2"


def test_verbatim_command_sentencepiece_target(hub, tmp_path):
    """No --target, a SentencePiece target: tokens, scores and types from tokenizer.model."""
    import sentencepiece as spm

    proc = _run(hub, tmp_path / "work", "hf-to-gguf", "tiny-org/Tiny-SPM-DFlash2", "--outtype", "q8_0")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "work" / "Tiny-SPM-DFlash2-Q8_0.gguf"
    assert proc.stdout.strip() == str(out) and out.is_file()
    assert "target: tiny-org/Tiny-SPM-Target (from model card base_model)" in proc.stderr

    sp = spm.SentencePieceProcessor(model_proto=hub["spm_files"]["tokenizer.model"])
    n = sp.vocab_size()
    kv = _tok(out)
    tokens = [t.decode() for t in kv["tokenizer.ggml.tokens"][0]]
    assert tokens == [sp.IdToPiece(i) for i in range(n)] + ["<|im_start|>", "<|im_end|>", " hello"]
    np.testing.assert_array_equal(np.float32(kv["tokenizer.ggml.scores"][0]),
                                  np.float32([sp.GetScore(i) for i in range(n)] + [-1000.0] * 3))
    types = kv["tokenizer.ggml.token_type"][0]
    # <unk> UNKNOWN, <s> </s> <mask> CONTROL, <tool> NORMAL (upstream's _create_vocab_sentencepiece
    # has no user-defined case for the model's own pieces), 256 BYTE pieces, then NORMAL; the added
    # tokens: two CONTROL (special), one USER_DEFINED
    assert types[:5] == [2, 3, 3, 3, 1] and types[5:261] == [6] * 256 and set(types[261:n]) == {1}
    assert types[n:] == [3, 3, 4]
    assert kv["tokenizer.ggml.model"][0] == b"llama" and kv["tokenizer.ggml.pre"][0] == b"default"
    assert (kv["tokenizer.ggml.bos_token_id"][0], kv["tokenizer.ggml.eos_token_id"][0]) == (1, 2)
    assert (kv["tokenizer.ggml.add_bos_token"][0], kv["tokenizer.ggml.add_eos_token"][0]) == (True, False)
    assert kv["tokenizer.chat_template"][0] == CHAT_TEMPLATE.encode()


def test_offline_and_missing_target_is_one_clear_line(hub, tmp_path):
    work = tmp_path / "work"
    proc = _run(hub, work, "hf-to-gguf", "tiny-org/Tiny-Orphan-DFlash2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: tiny-org/Missing-Target is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in lines[0] and "pass --target" in lines[0]
    assert list(work.iterdir()) == [] and proc.stdout == ""

    # an uncached drafter: the same kind of line, naming the drafter
    proc = _run(hub, work, "hf-to-gguf", "tiny-org/Not-Cached-DFlash2")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "tiny-org/Not-Cached-DFlash2 is not in the Hugging Face cache" in proc.stderr
    assert "local folder" in proc.stderr and list(work.iterdir()) == []


def test_target_given_as_hub_id_and_as_hub_gguf(hub, tmp_path):
    """--target org/name (tokenizer files) and --target org/name:QUANT (that GGUF) give the orphan
    drafter the same tokenizer as its SentencePiece target's own GGUF."""
    a = _run(hub, tmp_path / "a", "hf-to-gguf", "tiny-org/Tiny-Orphan-DFlash2", "--target", "tiny-org/Tiny-SPM-Target")
    assert a.returncode == 0, a.stderr
    assert "target: tiny-org/Tiny-SPM-Target (from --target)" in a.stderr
    b = _run(hub, tmp_path / "b", "hf-to-gguf", "tiny-org/Tiny-Orphan-DFlash2", "--target",
             "tiny-org/Tiny-SPM-Target-GGUF:q4_k_m")
    assert b.returncode == 0, b.stderr
    assert "target: tiny-org/Tiny-SPM-Target-GGUF:q4_k_m (from --target) -> " in b.stderr
    assert b.stderr.strip().endswith("Tiny-SPM-Target-Q4_K_M.gguf")
    ta, tb = _tok(a.stdout.strip()), _tok(b.stdout.strip())
    tg = _tok(hub["spm_gguf"])
    assert ta == tb
    assert {k: v for k, v in ta.items() if k != "tokenizer.ggml.mask_token_id"} == tg

    c = _run(hub, tmp_path / "c", "hf-to-gguf", "tiny-org/Tiny-Orphan-DFlash2", "--target",
             "tiny-org/Tiny-SPM-Target-GGUF:IQ2_XXS")
    assert c.returncode == 2 and "has no .gguf whose name contains 'IQ2_XXS'" in c.stderr
    assert list((tmp_path / "c").iterdir()) == []


def test_config_target_field_beats_the_card(hub, tmp_path):
    proc = _run(hub, tmp_path / "w", "hf-to-gguf", "tiny-org/Tiny-Cfg-DFlash2", "--outtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert "target: tiny-org/Tiny-SPM-Target (from config.json dflash_config.target_model)" in proc.stderr
    assert _tok(proc.stdout.strip())["tokenizer.ggml.model"][0] == b"llama"


def test_no_argument_drafter_pairs_with_its_target_in_libllama(hub, tmp_path):
    """Done-when of issue 42: the no-argument command writes a GGUF that libllama pairs with the
    target (the target's GGUF from the same hub cache)."""
    proc = _run(hub, tmp_path / "w", "hf-to-gguf", "tiny-org/Tiny-SPM-DFlash2")
    assert proc.returncode == 0, proc.stderr
    out = Path(proc.stdout.strip())
    target = hub["spm_gguf"]
    insp = _run(hub, tmp_path / "w", "inspect", str(out), "--target", str(target))
    assert insp.returncode == 0, insp.stderr
    info = json.loads(insp.stdout)
    assert (info["version"], info["fits"], info["reasons"]) == ("v2", True, [])

    ll = pytest.importorskip("llama_cpp.llama_cpp")
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    tm = ll.llama_model_load_from_file(str(target).encode(), mp)
    dm = ll.llama_model_load_from_file(str(out).encode(), mp)
    assert tm and dm
    try:
        assert ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(dm)) == hub["n_spm"]
        assert ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(tm)) == hub["n_spm"]
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 128, 32, 32, 2, 2
        tctx = ll.llama_init_from_model(tm, cp)
        cp.ctx_other = tctx
        dctx = ll.llama_init_from_model(dm, cp)
        assert tctx and dctx
        ll.llama_set_causal_attn(dctx, False)
        batch = ll.llama_batch_init(6, 0, 1)
        for i, tok in enumerate([1] + [MASK] * 5):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = 6
        assert ll.llama_decode(dctx, batch) == 0
        row = np.ctypeslib.as_array(ll.llama_get_logits_ith(dctx, 1), shape=(hub["n_spm"],))
        assert np.isfinite(row).all() and row.std() > 0
        ll.llama_batch_free(batch)
        ll.llama_free(dctx)
        ll.llama_free(tctx)
    finally:
        ll.llama_model_free(dm)
        ll.llama_model_free(tm)


# --------------------------------------------------------------------------------------------
# the pieces, in-process


def _folder(tmp_path, config: dict, card=None) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if card is not None:
        (tmp_path / "README.md").write_text(card if isinstance(card, str) and card.startswith("---") else _card(card))
    return tmp_path


@pytest.mark.parametrize("config,card,want", [
    ({}, "org/From-Card", ("org/From-Card", "model card base_model")),
    ({}, ["org/From-Card"], ("org/From-Card", "model card base_model")),
    ({"base_model": "org/Cfg-Base"}, None, ("org/Cfg-Base", "config.json base_model")),
    ({"target_model": "org/Top"}, "org/Card", ("org/Top", "config.json target_model")),
    ({"target_model_name_or_path": "org/T", "dflash_config": {"target_model_id": "org/T"}}, None,
     ("org/T", "config.json dflash_config.target_model_id")),
    ({"dflash_config": {"target_model": {"name_or_path": "org/Nested"}}}, None,
     ("org/Nested", "config.json dflash_config.target_model")),
    # a path from the authors' machine is skipped; the card decides
    ({"target_model_name_or_path": "/mnt/ckpt/Qwen3-8B"}, "Qwen/Qwen3-8B", ("Qwen/Qwen3-8B", "model card base_model")),
    # the same id spelt in two cases is one target
    ({"target_model": "Org/Model", "dflash_config": {"target_model": "org/model"}}, None,
     ("org/model", "config.json dflash_config.target_model")),
])
def test_target_from_drafter(tmp_path, config, card, want):
    assert target_from_drafter(_folder(tmp_path, config, card), config) == want


@pytest.mark.parametrize("config,card,msg", [
    ({}, None, "does not say which target.*no base_model in its model card.*pass --target"),
    ({}, ["org/A", "org/B"], r"names several targets: org/A \(model card base_model\); org/B"),
    ({"target_model": "org/A", "dflash_config": {"target_model": "org/B"}}, None, "names several targets"),
    ({"target_model_path": "/nowhere/model"}, None, r"target \(config.json target_model_path = '/nowhere/model'\) "
                                                    "is neither a hub id nor a path here; pass --target"),
    ({}, "---\nbase_model: [unclosed\n---\n", "does not say which target"),
])
def test_target_from_drafter_refusals(tmp_path, config, card, msg):
    with pytest.raises(ConversionError, match=msg):
        target_from_drafter(_folder(tmp_path, config, card), config)


def test_pick_gguf():
    files = ["README.md", "Q-8B-Q4_K_M.gguf", "Q-8B-Q4_K_S.gguf", "Q-8B-Q8_0.gguf", "mmproj-Q-8B-Q8_0.gguf",
             "BF16/Q-8B-BF16-00001-of-00002.gguf", "BF16/Q-8B-BF16-00002-of-00002.gguf"]
    assert pick_gguf(files, "q4_k_m", "o/r") == "Q-8B-Q4_K_M.gguf"
    assert pick_gguf(files, "Q8_0", "o/r") == "Q-8B-Q8_0.gguf"          # not the mmproj
    assert pick_gguf(files, "bf16", "o/r") == "BF16/Q-8B-BF16-00001-of-00002.gguf"
    with pytest.raises(ConversionError, match=r"o/r:Q4_K is ambiguous \(Q-8B-Q4_K_M.gguf, Q-8B-Q4_K_S.gguf\)"):
        pick_gguf(files, "Q4_K", "o/r")
    with pytest.raises(ConversionError, match="no .gguf whose name contains 'Q2_K'.*pass --target o/r:<one"):
        pick_gguf(files, "Q2_K", "o/r")
    assert parse_hub_gguf("unsloth/Qwen3-8B-GGUF:Q4_K_M") == ("unsloth/Qwen3-8B-GGUF", "Q4_K_M")
    assert parse_hub_gguf("unsloth/Qwen3-8B-GGUF") is None and parse_hub_gguf("a/b/c:Q4") is None


def test_tiktoken_and_tekken_targets_name_the_fix(tmp_path):
    from convert.target_vocab import target_vocab_fields

    with pytest.raises(ConversionError, match=r"\(QWenLMHeadModel\) has a tiktoken tokenizer.*pass the target's GGUF"):
        target_vocab_fields(tmp_path, 10, "QWenLMHeadModel")
    (tmp_path / "tekken.json").write_text("{}")
    with pytest.raises(ConversionError, match="tekken.json tokenizer is not converted here; pass the target's GGUF"):
        target_vocab_fields(tmp_path, 10, "MistralForCausalLM")
    (tmp_path / "tekken.json").unlink()
    with pytest.raises(ConversionError, match="has no tokenizer.model; pass the target's GGUF"):
        target_vocab_fields(tmp_path, 10, "Gemma2ForCausalLM")
