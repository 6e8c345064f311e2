"""Drafter training: parity with the authors' reference, export, objective, loop, resume.

Needs torch; the reference comparisons also need ``dflash==0.1.0`` (+ transformers). No network
beyond the cached SmolLM2 GGUF (``smollm2_gguf`` fixture).
"""

from __future__ import annotations

import json
import shutil

import numpy as np

import pytest

torch = pytest.importorskip("torch")

from dflash2_gguf.train import objective as O  # noqa: E402
from dflash2_gguf.train.data import FeatureShards, ShardMeta, write_shard  # noqa: E402
from dflash2_gguf.train.export import export_hf, load_hf  # noqa: E402
from dflash2_gguf.train.loop import TrainConfig, lr_lambda, train  # noqa: E402
from dflash2_gguf.train.model import (  # noqa: E402
    REFERENCE_KEY_MAP,
    DFlash2Config,
    DFlash2Drafter,
    build_target_layer_ids,
)

V, H = 300, 64


def small_config(**kw) -> DFlash2Config:
    base = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=V, num_target_layers=8,
                target_layer_ids=(1, 3, 5), mask_token_id=V - 1, block_size=8, selector_rank=12,
                selector_top_k=5)
    base.update(kw)
    return DFlash2Config(**base)


def random_drafter(cfg: DFlash2Config, seed: int = 0) -> DFlash2Drafter:
    """Random weights with non-trivial norms and conv base kernels; target tensors attached."""
    torch.manual_seed(seed)
    m = DFlash2Drafter(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "base_kernel" in n or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    m.set_target_weights(torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.5,
                         torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.5)
    return m.float().eval()


def reference_of(m: DFlash2Drafter):
    """The authors' DFlash2DraftModel with the same weights (and its output head module)."""
    pytest.importorskip("transformers")
    ref_mod = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    ref = ref_mod.DFlash2DraftModel(Qwen3Config(**m.config.to_hf_dict("float32"))).float().eval()
    ref.load_state_dict({REFERENCE_KEY_MAP.get(k, k): v for k, v in m.state_dict().items()}, strict=True)
    head = torch.nn.Linear(m.config.hidden_size, m.config.vocab_size, bias=False)
    head.weight.data = m.lm_head.clone()
    return ref, head


# ------------------------------------------------------------------------------------------
# Parity with dflash==0.1.0
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["plain", "scaled_softcap", "sliding"])
def test_drafter_matches_reference_single_block(variant):
    kw = {}
    if variant == "scaled_softcap":
        kw = dict(output_multiplier=0.7, final_logit_softcapping=5.0, input_embedding_scale=1.3)
    if variant == "sliding":
        kw = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=5, is_causal=None)
    m = random_drafter(small_config(**kw))
    ref, head = reference_of(m)
    c, bs = 11, m.config.block_size
    th = torch.randn(2, c, 3 * H)
    ids = torch.full((2, bs), m.config.mask_token_id)
    ids[:, 0] = torch.tensor([5, 17])
    pos = torch.arange(c + bs)[None].expand(2, -1)
    with torch.no_grad():
        h = m(m.embed(ids), th, pos)
        emb_ref = torch.nn.functional.embedding(ids, m.embed_tokens) * float(kw.get("input_embedding_scale", 1.0))
        hr = ref(position_ids=pos, noise_embedding=emb_ref, target_hidden=th)
        assert (h - hr).abs().max() < 1e-5
        logits, logits_ref = m.compute_logits(h), ref.compute_logits(hr, head)
        assert (logits - logits_ref).abs().max() < 1e-4
        # Greedy selector walk: same path, same candidates.
        path, cand, _ = m.candidate_selector.select(h[:, 1:], logits[:, 1:], ids[:, 0], 0.0)
        rpath, rcand, _ = ref.propose(hr[:, 1:], ids[:, 0], head, 0.0)
        assert torch.equal(path, rpath) and torch.equal(cand, rcand)
        # Sampled walk: our teacher-forced scores on the reference's path give its q.
        torch.manual_seed(3)
        spath, scand, q = ref.propose(hr[:, 1:], ids[:, 0], head, 0.8)
        pred = torch.cat([ids[:, :1], spath[:, :-1]], 1)
        unary, cand = m.candidate_selector.candidates(logits[:, 1:])
        scores = m.candidate_selector.scores(h[:, 1:], unary, cand, pred)
        assert torch.equal(cand, scand)
        assert (torch.softmax(scores / 0.8, -1) - q).abs().max() < 1e-5


def test_batched_anchors_match_reference_passes():
    """The training mask (many anchors in one forward) == one reference pass per anchor."""
    m = random_drafter(small_config())
    ref, _ = reference_of(m)
    bs, L = m.config.block_size, 40
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, V - 1, (2, L), generator=g)
    feat = torch.randn(2, L, 3 * H, generator=g)
    lengths = torch.tensor([40, 30])
    pos = torch.arange(L)[None] + torch.tensor([[0], [5]])  # second row: a window at offset 5
    anc, valid = O.sample_anchors(lengths, torch.tensor([3, 0]), 4, g)
    assert valid.all() and (anc >= 1).all() and (anc <= lengths[:, None] - 2).all()
    ids, bpos, labels, pred = O.block_inputs(tok, pos, lengths, anc, valid, bs, m.config.mask_token_id)
    mask = O.block_attention_mask(anc, L, bs)
    with torch.no_grad():
        h = m(m.embed(ids), feat, torch.cat([pos, bpos], 1), attention_mask=mask, block_len=bs)
    h = h.view(2, 4, bs, H)
    for b in range(2):
        for a in range(4):
            p = int(anc[b, a])
            # labels / predecessors are the true next / previous tokens
            k = torch.arange(1, bs)
            want = torch.where(p + k < lengths[b], tok[b, (p + k).clamp(max=L - 1)], -100)
            assert torch.equal(labels[b, a, 1:], want)
            assert torch.equal(pred[b, a, 1:], tok[b, p + k - 1])
            with torch.no_grad():
                hr = ref(position_ids=(torch.arange(p + bs) + pos[b, 0])[None],
                         noise_embedding=m.embed(ids[b:b + 1, a * bs:(a + 1) * bs]),
                         target_hidden=feat[b:b + 1, :p])
            assert (hr[0] - h[b, a]).abs().max() < 1e-5


# ------------------------------------------------------------------------------------------
# Checkpoint format
# ------------------------------------------------------------------------------------------


def test_state_dict_is_the_authors_checkpoint(tmp_path):
    from checkpoints import make_dflash_checkpoint
    from safetensors import safe_open

    path = make_dflash_checkpoint(tmp_path / "ck", hidden_size=H, intermediate_size=96,
                                  num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=V,
                                  target_layer_ids=(1, 3, 5), num_target_layers=8,
                                  selector_rank=12, selector_top_k=5, dtype="float32")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    m = load_hf(path)
    ours = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert ours == theirs
    assert m.config.target_layer_ids == (1, 3, 5) and m.config.block_size == 8


def test_export_loads_in_reference(tmp_path):
    ref_mod = pytest.importorskip("dflash.model")
    m = random_drafter(small_config())
    out = export_hf(m, tmp_path / "hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["selector_top_k"] == 5
    ref = ref_mod.DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32)
    theirs = ref.state_dict()
    for k, v in m.state_dict().items():
        assert torch.equal(theirs[REFERENCE_KEY_MAP.get(k, k)], v), k
    assert set(map(lambda k: REFERENCE_KEY_MAP.get(k, k), m.state_dict())) == set(theirs)
    back = load_hf(out)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in m.state_dict().items())
    with pytest.raises(FileExistsError):
        export_hf(m, out)
    export_hf(m, out, dtype="bfloat16", force=True)
    assert load_hf(out).fc.weight.dtype == torch.float32


@pytest.mark.slow
def test_export_converts_to_gguf(tmp_path, smollm2_gguf):
    """(slow: the converter parses the target's 49k-token vocabulary, ~15-30 s on 2 cores)"""
    convert = pytest.importorskip("convert.hf_to_gguf")
    from gguf import GGUFReader

    cfg = small_config(hidden_size=576, vocab_size=49152, num_target_layers=30,
                       target_layer_ids=tuple(build_target_layer_ids(30, 2)), mask_token_id=2,
                       selector_top_k=16, selector_rank=16, num_attention_heads=4, head_dim=16)
    m = DFlash2Drafter(cfg)
    out = export_hf(m, tmp_path / "hf", dtype="bfloat16")
    gg = convert.convert_hf_to_gguf(out, smollm2_gguf, tmp_path / "d.gguf", "f16")
    r = GGUFReader(str(gg))
    assert len(r.tensors) == len(m.state_dict())
    assert r.fields["general.architecture"].contents() == "dflash"


@pytest.fixture(scope="module")
def smollm2_reader(smollm2_gguf):
    """GGUFReader of the real target, parsed once per module (its vocabulary takes seconds)."""
    from gguf import GGUFReader

    return GGUFReader(str(smollm2_gguf))


@pytest.fixture(scope="module")
def smollm2_weights(smollm2_reader):
    """The real target's dequantized embedding (tied head), read once per module."""
    from dflash2_gguf.train.target_weights import load_target_weights

    return load_target_weights(smollm2_reader)


def test_target_weights_from_real_gguf(smollm2_reader, smollm2_weights):
    tw = smollm2_weights
    assert tw.info.arch == "llama" and tw.info.n_layers == 30
    assert tw.embed.shape == (49152, 576) and tw.head is None  # tied embeddings
    assert np.isfinite(tw.embed).all()
    # Q8_0 by hand for token 1: blocks of (f16 scale, 32 x int8).
    t = next(t for t in smollm2_reader.tensors if t.name == "token_embd.weight")
    assert t.tensor_type.name == "Q8_0"
    row = np.asarray(t.data[1]).reshape(-1, 34)
    d = row[:, :2].copy().view(np.float16).astype(np.float32)
    q = row[:, 2:].view(np.int8).astype(np.float32)
    np.testing.assert_allclose(tw.embed[1], (d * q).reshape(-1), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# Objective, data, loop
# ------------------------------------------------------------------------------------------


def _synthetic_shard(path, cfg: DFlash2Config, n_seq: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n_seq):
        n = int(rng.integers(20, 40))
        x = [int(rng.integers(0, cfg.vocab_size - 1))]
        for _ in range(n - 1):
            x.append((x[-1] * 7 + 3) % (cfg.vocab_size - 1))
        feats = rng.standard_normal((n, len(cfg.target_layer_ids) * cfg.hidden_size)).astype(np.float32)
        seqs.append((x, feats, int(rng.integers(1, 5))))
    return write_shard(path, seqs, ShardMeta(cfg.target_layer_ids, cfg.hidden_size, cfg.vocab_size))


def _tiny():
    return small_config(num_hidden_layers=1, target_layer_ids=(1, 2), block_size=4,
                        selector_rank=8, selector_top_k=4, intermediate_size=128)


def test_shard_roundtrip_and_windows(tmp_path):
    cfg = _tiny()
    p = _synthetic_shard(tmp_path / "s.safetensors", cfg)
    data = FeatureShards([p])
    assert len(data) == 16 and data.meta.target_layer_ids == (1, 2)
    batch = data.sample_batch(8, 16, torch.Generator().manual_seed(0))
    assert batch.tokens.shape == (8, 16) and batch.features.dtype == torch.float16
    assert batch.features.shape == (8, 16, 2 * H)
    assert (batch.lengths <= 16).all() and (batch.lengths - batch.anchor_min >= 2).all()
    # windowed rows keep their absolute positions and the sequence's recurrence
    for b in range(8):
        n = int(batch.lengths[b])
        t = batch.tokens[b, :n]
        assert torch.equal(t[1:], (t[:-1] * 7 + 3) % (V - 1))
        assert torch.equal(batch.positions[b, 1:] - batch.positions[b, :-1], torch.ones(15, dtype=torch.long))


def _family_shard(path, cfg: DFlash2Config, families, seed: int = 0):
    """Sequences of two recurrences: family "math" x -> 7x + 3, "code" x -> x + 1 (mod V - 1)."""
    rng = np.random.default_rng(seed)
    seqs = []
    for fam in families:
        n = int(rng.integers(20, 40))
        x = [int(rng.integers(0, cfg.vocab_size - 1))]
        for _ in range(n - 1):
            x.append((x[-1] * 7 + 3 if fam == "math" else x[-1] + 1) % (cfg.vocab_size - 1))
        feats = rng.standard_normal((n, len(cfg.target_layer_ids) * cfg.hidden_size)).astype(np.float32)
        seqs.append((x, feats, 2, fam))
    return write_shard(path, seqs, ShardMeta(cfg.target_layer_ids, cfg.hidden_size, cfg.vocab_size))


def test_shard_prompt_families(tmp_path):
    """Each sequence's prompt family survives the shard round trip; a family's batches hold that
    family's sequences only; a shard of untagged sequences has none; mixing the two is refused."""
    from safetensors import safe_open

    cfg = _tiny()
    fams = ["math", "code", "math", "math", "code", "math"]
    p = _family_shard(tmp_path / "f.safetensors", cfg, fams)
    with safe_open(str(p), "np") as f:
        assert json.loads(f.metadata()["families"]) == ["code", "math"]
        assert f.get_tensor("family").tolist() == [1, 0, 1, 1, 0, 1]
    q = _synthetic_shard(tmp_path / "plain.safetensors", cfg, n_seq=3)
    data = FeatureShards([p, q])
    assert data.family_of == fams + ["", "", ""] and data.families == ["code", "math"]
    assert FeatureShards([q]).families == []
    g = torch.Generator().manual_seed(0)
    for fam, step in (("code", lambda t: (t + 1) % (V - 1)), ("math", lambda t: (t * 7 + 3) % (V - 1))):
        batch = data.sample_batch(16, 16, g, family=fam)
        for b in range(16):
            t = batch.tokens[b, :int(batch.lengths[b])]
            assert torch.equal(t[1:], step(t[:-1])), fam
    with pytest.raises(KeyError, match="chat"):
        data.sample_batch(2, 16, g, family="chat")
    with pytest.raises(ValueError, match="every sequence"):
        write_shard(tmp_path / "bad.safetensors", [([1, 2, 3], np.zeros((3, 2 * H)), 1, "math"),
                                                   ([1, 2, 3], np.zeros((3, 2 * H)), 1)],
                    ShardMeta(cfg.target_layer_ids, cfg.hidden_size, cfg.vocab_size))
    assert not (tmp_path / "bad.safetensors").exists()

    from dflash2_gguf.train.loop import evaluate_tau

    m = random_drafter(cfg)
    m.set_target_weights(torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.3, None)
    tcfg = TrainConfig(shards=[str(p)], out_dir=str(tmp_path / "run"), batch_size=4, max_len=24,
                       anchors_per_seq=4, eval_batches=1, progress=False)
    ev = evaluate_tau(m, FeatureShards([p]), tcfg)
    assert sorted(ev["tau_by_family"]) == ["code", "math"]
    assert all(1.0 <= x <= cfg.block_size for x in ev["tau_by_family"].values())
    assert "tau_by_family" not in evaluate_tau(m, FeatureShards([q]), tcfg)


def test_loss_weights_and_accuracy_counts():
    cfg = _tiny()
    m = random_drafter(cfg)
    g = torch.Generator().manual_seed(1)
    L = 24
    tok = torch.randint(0, V - 1, (2, L), generator=g)
    batch = O.Batch(tok, torch.randn(2, L, 2 * H, generator=g), torch.arange(L).expand(2, -1),
                    torch.tensor([24, 10]), torch.tensor([0, 2]))
    out = O.dflash2_loss(m, batch, 5, generator=g)
    assert out.loss.requires_grad and torch.isfinite(out.loss)
    assert out.count.shape == (cfg.block_size - 1,) and (out.correct <= out.count).all()
    assert O.default_gamma(16) == 7.0 and O.default_gamma(8) == 4.0
    out.loss.backward()
    assert m.candidate_selector.predecessor_codebook.grad is not None
    assert m.embed_tokens.grad is None  # frozen


def test_feature_dropout_drops_fused_context_rows_in_training_only():
    """``feature_dropout=p`` zeroes a share p of the fused context features (``hidden_norm(fc(.))``)
    that every layer attends to, scales the rest by 1 / (1 - p), and does nothing in eval mode
    (inference, held-out tau) or at p = 0; the loss passes it through."""
    cfg = _tiny()
    m = random_drafter(cfg)
    g = torch.Generator().manual_seed(2)
    C, Q = 30, cfg.block_size
    feats = torch.randn(1, C, 2 * H, generator=g)
    emb = m.embed(torch.randint(0, V - 1, (1, Q), generator=g))
    pos = torch.arange(C + Q)[None]
    seen = []
    hook = m.layers[0].register_forward_pre_hook(lambda mod, args: seen.append(args[1].detach().clone()))
    m.train()
    h0 = m(emb, feats, pos, feature_dropout=0.0)
    torch.manual_seed(3)
    h1 = m(emb, feats, pos, feature_dropout=0.5)
    torch.manual_seed(3)
    h1_again = m(emb, feats, pos, feature_dropout=0.5)
    m.eval()
    h_eval = m(emb, feats, pos, feature_dropout=0.5)
    hook.remove()
    ctx0, ctx1, _, ctx_eval = seen
    dropped = ctx1 == 0
    assert 0.4 < dropped.float().mean() < 0.6                       # p = 0.5 of C * H entries
    assert torch.allclose(ctx1[~dropped], 2.0 * ctx0[~dropped], atol=1e-6)
    assert torch.equal(ctx_eval, ctx0) and torch.equal(h_eval, h0)  # eval mode: off
    assert torch.equal(h1, h1_again) and not torch.allclose(h1, h0, atol=1e-3)

    m.train()
    L = 24
    batch = O.Batch(torch.randint(0, V - 1, (2, L), generator=g), torch.randn(2, L, 2 * H, generator=g),
                    torch.arange(L).expand(2, -1), torch.tensor([24, 20]), torch.tensor([0, 2]))
    anchors = O.sample_anchors(batch.lengths, batch.anchor_min, 5, torch.Generator().manual_seed(1))
    plain = O.dflash2_loss(m, batch, 5, anchors=anchors)
    assert torch.equal(O.dflash2_loss(m, batch, 5, anchors=anchors, feature_dropout=0.0).loss, plain.loss)
    assert not torch.allclose(O.dflash2_loss(m, batch, 5, anchors=anchors, feature_dropout=0.5).loss,
                              plain.loss)


def test_loss_goes_down_on_synthetic_shard(tmp_path):
    cfg = _tiny()
    p = _synthetic_shard(tmp_path / "s.safetensors", cfg)
    emb = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.3
    ev = _synthetic_shard(tmp_path / "eval.safetensors", cfg, n_seq=4, seed=1)
    model, state = train(cfg, TrainConfig(shards=[str(p)], out_dir=str(tmp_path / "run"), steps=30,
                                          lr=3e-3, warmup_steps=3, batch_size=4, max_len=24,
                                          anchors_per_seq=4, log_every=10, save_every=100,
                                          progress=False, eval_shards=[str(ev)], eval_batches=1),
                         target_weights=(emb, None))
    taus = [h for h in state.history if "tau" in h]
    assert len(taus) == 1 and 1.0 <= taus[0]["tau"] <= cfg.block_size
    assert sum(taus[0]["tau_hist"]) == taus[0]["n_anchors"] > 0
    losses = [h["loss"] for h in state.history if "loss" in h]
    assert state.step == 30 and len(losses) == 3
    assert losses[-1] < 0.7 * losses[0], losses
    assert (tmp_path / "run" / "hf" / "model.safetensors").exists()
    assert (tmp_path / "run" / "checkpoint.pt").exists()


def test_resume_restores_step_and_optimizer(tmp_path):
    cfg = _tiny()
    p = _synthetic_shard(tmp_path / "s.safetensors", cfg)
    emb = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.3
    kw = dict(shards=[str(p)], steps=8, lr=3e-3, warmup_steps=2, batch_size=2, max_len=24,
              anchors_per_seq=3, save_every=100, progress=False)
    # Interrupted at step 4, then resumed to 8 ...
    m_a, st_a = train(cfg, TrainConfig(out_dir=str(tmp_path / "a"), stop_at=4, **kw), target_weights=(emb, None))
    assert st_a.step == 4 and not (tmp_path / "a" / "hf").exists()
    ck = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    assert ck["step"] == 4 and ck["scheduler"]["last_epoch"] == 4
    assert all(int(s["step"]) == 4 for s in ck["optimizer"]["state"].values())
    m_b, st_b = train(cfg, TrainConfig(out_dir=str(tmp_path / "a"), **kw), target_weights=(emb, None))
    # ... equals one uninterrupted run of 8 steps.
    m_c, st_c = train(cfg, TrainConfig(out_dir=str(tmp_path / "c"), **kw), target_weights=(emb, None))
    assert st_b.step == st_c.step == 8
    for k, v in m_c.state_dict().items():
        assert torch.allclose(m_b.state_dict()[k], v, atol=1e-6, rtol=0), k


def test_weight_decay_applies_and_resume_takes_the_new_value(tmp_path):
    from dflash2_gguf.train.cli import build_parser

    args = build_parser().parse_args(["fit", "--target", "t.gguf", "--shards", "s", "--out", "o",
                                      "--weight-decay", "0.25"])
    assert args.weight_decay == 0.25
    cfg = _tiny()
    p = _synthetic_shard(tmp_path / "s.safetensors", cfg)
    emb = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.3
    kw = dict(shards=[str(p)], steps=6, lr=3e-3, warmup_steps=2, batch_size=2, max_len=24,
              anchors_per_seq=3, save_every=100, progress=False)
    train(cfg, TrainConfig(out_dir=str(tmp_path / "a"), stop_at=3, **kw), target_weights=(emb, None))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    m_0, _ = train(cfg, TrainConfig(out_dir=str(tmp_path / "a"), **kw), target_weights=(emb, None))
    m_wd, _ = train(cfg, TrainConfig(out_dir=str(tmp_path / "b"), weight_decay=0.5, **kw),
                    target_weights=(emb, None))
    groups = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    w0, wd = m_0.state_dict(), m_wd.state_dict()
    # matrices shrink towards zero (AdamW's decoupled decay); 1-d norms and biases are untouched
    # by the decay, so they match the run without it only through the shared gradients
    mats = [k for k, v in wd.items() if v.dim() >= 2 and v.dtype.is_floating_point]
    assert mats and sum(wd[k].norm() for k in mats) < sum(w0[k].norm() for k in mats)


def test_bf16_autocast_trains_in_bfloat16_keeps_float32_state_and_resumes_across_precisions(tmp_path):
    """``autocast_dtype="bfloat16"`` (``fit --bf16``, the default on a CUDA GPU) run on the CPU:
    the matmuls compute in bfloat16 (a hook on ``fc`` sees bfloat16 outputs, the float32 run's
    float32), the losses are finite and within bfloat16 rounding of the float32 run's without
    being equal to them; weights, AdamW moments and the checkpoint stay float32 with the float32
    run's keys and shapes, the export has the float32 run's tensors, dtypes and config; a bf16 run
    resumed equals an uninterrupted one, and a bf16 checkpoint resumes in float32."""
    from safetensors import safe_open

    cfg = _tiny()
    p = _synthetic_shard(tmp_path / "s.safetensors", cfg)
    emb = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.3
    kw = dict(shards=[str(p)], steps=6, lr=3e-3, warmup_steps=2, batch_size=2, max_len=24,
              anchors_per_seq=3, save_every=100, log_every=1, progress=False)

    def run(name, amp, **extra):
        torch.manual_seed(0)
        model = DFlash2Drafter(cfg)  # the same initial weights for every run
        seen = set()
        model.fc.register_forward_hook(lambda mod, i, o: seen.add(o.dtype) if mod.training else None)
        m, st = train(cfg, TrainConfig(out_dir=str(tmp_path / name), autocast_dtype=amp, **kw, **extra),
                      target_weights=(emb, None), model=model)
        return m, [h["loss"] for h in st.history if "loss" in h], seen

    m32, loss32, seen32 = run("fp32", None)
    m16, loss16, seen16 = run("bf16", "bfloat16")
    assert seen32 == {torch.float32} and seen16 == {torch.bfloat16}
    assert len(loss16) == 6 and all(np.isfinite(loss16))
    assert loss16[0] != loss32[0] and loss16[0] == pytest.approx(loss32[0], rel=2e-2)
    assert loss16[-1] < loss16[0]
    assert all(t.dtype == torch.float32 for t in m16.state_dict().values() if t.is_floating_point())
    ck32, ck16 = (torch.load(tmp_path / n / "checkpoint.pt", weights_only=False) for n in ("fp32", "bf16"))
    assert {k: (v.dtype, v.shape) for k, v in ck16["model"].items()} == \
        {k: (v.dtype, v.shape) for k, v in ck32["model"].items()}
    moments = [t for st in ck16["optimizer"]["state"].values() for k, t in st.items() if k != "step"]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    heads = []
    for n in ("fp32", "bf16"):
        with safe_open(str(tmp_path / n / "hf" / "model.safetensors"), "pt") as f:
            heads.append({k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()})
    assert heads[0] == heads[1] and {d for d, _ in heads[1].values()} == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "hf" / "config.json").read_text()) == \
        json.loads((tmp_path / "fp32" / "hf" / "config.json").read_text())
    assert load_hf(tmp_path / "bf16" / "hf").config == load_hf(tmp_path / "fp32" / "hf").config
    # interrupted at step 3, resumed to 6 in bfloat16: the uninterrupted bf16 run's weights
    run("cut", "bfloat16", stop_at=3)
    shutil.copytree(tmp_path / "cut", tmp_path / "cut32")
    m_res, loss_res, _ = run("cut", "bfloat16")
    assert loss_res == loss16
    for k, v in m16.state_dict().items():
        assert torch.allclose(m_res.state_dict()[k], v, atol=1e-6, rtol=0), k
    # the same bf16 checkpoint resumed in float32: 3 more steps, float32 matmuls
    m_f, loss_f, seen_f = run("cut32", None)
    assert seen_f == {torch.float32} and loss_f[:3] == loss16[:3] and loss_f[3:] != loss16[3:]
    assert torch.load(tmp_path / "cut32" / "checkpoint.pt", weights_only=False)["step"] == 6


def test_device_and_precision_resolution(monkeypatch):
    """``fit --device auto`` trains on CUDA when torch sees a GPU, else on the CPU; bfloat16
    autocast is the default there only on a GPU with bfloat16; a device torch does not see, a
    string that is no device, bf16 on an old GPU and float16 autocast are refused, naming the fix."""
    from dflash2_gguf.train.cli import build_parser, main
    from dflash2_gguf.train.loop import resolve_autocast, resolve_device

    args = build_parser().parse_args(["fit", "--target", "t.gguf", "--shards", "s", "--out", "o"])
    assert (args.device, args.bf16) == ("auto", None)
    base = ["fit", "--target", "t.gguf", "--shards", "s", "--out", "o"]
    assert build_parser().parse_args(base + ["--no-bf16"]).bf16 is False
    assert build_parser().parse_args(base + ["--bf16", "--device", "cuda:1"]).bf16 is True
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == cpu and resolve_device("cpu") == cpu
    assert resolve_device(" CPU ") == cpu and resolve_device("Auto") == cpu
    with pytest.raises(ValueError, match="device 'cuda': (this torch is a CPU build|torch sees no "
                                         "CUDA device).*give cpu"):
        resolve_device("cuda")
    with pytest.raises(SystemExit, match="--device: device 'cuda'.*give cpu"):
        main(base + ["--device", "cuda"])  # refused before the target or the shards are opened
    with pytest.raises(ValueError, match="'gpu' is not a torch device; give auto, cpu, cuda"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="'meta': give cpu, cuda, cuda:N or mps"):
        resolve_device("meta")
    assert resolve_autocast(cpu) is None and resolve_autocast(cpu, True) == "bfloat16"
    assert resolve_autocast(cpu, False) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == torch.device("cuda") == resolve_device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="1 CUDA device.*cuda:0 to cuda:0"):
        resolve_device("cuda:1")
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_autocast(gpu) == "bfloat16" and resolve_autocast(gpu, False) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_autocast(gpu) is None
    with pytest.raises(ValueError, match="no bfloat16 support.*no --bf16"):
        resolve_autocast(gpu, True)
    with pytest.raises(ValueError, match="float16 autocast needs a gradient scaler"):
        train(_tiny(), TrainConfig(shards=[], out_dir="unused", autocast_dtype="float16"),
              target_weights=(torch.zeros(V, H), None))


def test_fit_init_starts_from_an_exported_drafter(tmp_path):
    """``fit --init FOLDER``: the run starts from the folder's weights (what ``export`` wrote,
    float32 here) and trains on from them; a folder of another shape is refused, naming the field."""
    import dataclasses

    from dflash2_gguf.train.cli import _init_model, build_parser

    assert build_parser().parse_args(["fit", "--target", "t.gguf", "--shards", "s", "--out", "o",
                                      "--init", "hf"]).init == "hf"
    cfg = _tiny()
    src = random_drafter(cfg)
    with torch.no_grad():  # weights no fresh run of this seed starts from
        for q in src.parameters():
            q.add_(0.05 * torch.randn(q.shape, generator=torch.Generator().manual_seed(q.numel())))
    folder = export_hf(src, tmp_path / "hf", dtype="float32")
    m = _init_model(str(folder), cfg)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in src.state_dict().items())
    p = _synthetic_shard(tmp_path / "s.safetensors", cfg)
    emb = torch.randn(V, H, generator=torch.Generator().manual_seed(0)) * 0.3
    kw = dict(shards=[str(p)], steps=2, lr=1e-9, warmup_steps=0, batch_size=2, max_len=24,
              anchors_per_seq=3, save_every=100, progress=False)
    trained, st = train(cfg, TrainConfig(out_dir=str(tmp_path / "run"), eval_shards=[str(p)], eval_every=2,
                                         eval_batches=1, **kw), target_weights=(emb, None), model=m)
    # the curve starts at step 0 with the init's held-out tau (lr ~ 0: the same at step 2)
    (t0, t2) = [h for h in st.history if "tau" in h]
    assert (t0["step"], t2["step"]) == (0, 2) and t0["tau"] == pytest.approx(t2["tau"], abs=1e-6)
    fresh, _ = train(cfg, TrainConfig(out_dir=str(tmp_path / "fresh"), **kw), target_weights=(emb, None))
    w = src.state_dict()
    assert torch.allclose(trained.fc.weight, w["fc.weight"], atol=1e-6)  # lr ~ 0: still the init
    assert not torch.allclose(fresh.fc.weight, w["fc.weight"], atol=1e-2)  # a fresh run: other weights
    with pytest.raises(SystemExit, match="block_size: 4 in .*, 8 here"):
        _init_model(str(folder), dataclasses.replace(cfg, block_size=8))
    with pytest.raises(SystemExit, match="no config.json"):
        _init_model(str(tmp_path), cfg)


def test_grown_drafter_computes_what_the_shallower_one_did_then_trains_its_new_layer(tmp_path):
    """``grow_layers`` / ``fit --init FOLDER --layers N`` with N above the folder's: the new layers
    are appended as identities (hidden states, logits and selector paths equal to the 2-layer
    drafter's bit for bit), a gradient step moves them, and fewer layers than the folder's are
    refused."""
    import dataclasses

    from dflash2_gguf.train.cli import _init_model
    from dflash2_gguf.train.model import grow_layers

    cfg = small_config()
    src = random_drafter(cfg, seed=3)
    grown = grow_layers(src, 3, seed=1)
    assert grown.config.num_hidden_layers == 3 and len(grown.layers) == 3
    assert src.config.num_hidden_layers == 2 and len(src.layers) == 2  # the source is untouched
    new = grown.layers[2]
    assert new.self_attn.q_proj.weight.abs().sum() > 0 and new.mlp.gate_proj.weight.abs().sum() > 0
    g = torch.Generator().manual_seed(0)
    c, bs = 11, cfg.block_size
    feats = torch.randn(2, c, len(cfg.target_layer_ids) * H, generator=g)
    anchors = torch.tensor([5, 17])
    ids = torch.full((2, bs), cfg.mask_token_id)
    ids[:, 0] = anchors
    pos = torch.arange(20 - c, 20 + bs).expand(2, -1)
    with torch.no_grad():
        h_src = src(src.embed(ids), feats, pos)
        h_grown = grown(grown.embed(ids), feats, pos)
    assert torch.equal(h_src, h_grown)
    drafts_src, drafts_grown = src.draft(feats, anchors, 20), grown.draft(feats, anchors, 20)
    assert all(torch.equal(a, b) for a, b in zip(drafts_src[:2], drafts_grown[:2]))  # path, candidates

    # the new layer learns: its zero o_proj / down_proj get gradients at once
    grown.train()
    h = grown(grown.embed(ids), feats, pos)
    grown.compute_logits(h).logsumexp(-1).sum().backward()
    assert new.self_attn.o_proj.weight.grad.abs().sum() > 0 and new.mlp.down_proj.weight.grad.abs().sum() > 0

    folder = export_hf(src, tmp_path / "hf", dtype="float32")
    m = _init_model(str(folder), dataclasses.replace(cfg, num_hidden_layers=3))
    assert len(m.layers) == 3 and m.config.num_hidden_layers == 3
    assert all(torch.equal(m.state_dict()[k], v) for k, v in src.state_dict().items())
    assert m.layers[2].self_attn.o_proj.weight.abs().sum() == 0
    with pytest.raises(SystemExit, match="num_hidden_layers: 2 in .*, 1 here"):
        _init_model(str(folder), dataclasses.replace(cfg, num_hidden_layers=1))
    with pytest.raises(ValueError, match="not more than"):
        grow_layers(src, 2)


def test_lr_schedule():
    f = lr_lambda(10, 110, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)


def test_config_for_target_and_cli_helpers(tmp_path, smollm2_reader):
    from dflash2_gguf.train.cli import build_parser, load_prompts
    from dflash2_gguf.train.target_weights import read_target_info

    info = read_target_info(smollm2_reader)
    cfg = DFlash2Config.for_target(info)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (576, 9, 3, 64)
    assert cfg.target_layer_ids == (1, 8, 14, 20, 27) and cfg.rope_theta == 100000.0
    assert cfg.rms_norm_eps == 1e-5 and cfg.mask_token_id == 0  # SmolLM2's unknown token
    assert DFlash2Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    with pytest.raises(ValueError, match=r"below selector_top_k\*\(selector_top_k\+1\) = 600.*selector_top_k <= 23"):
        DFlash2Config.for_target(info, selector_top_k=24)  # 576 < 24 * 25; 23 * 24 = 552 fits
    with pytest.raises(ValueError, match="float16"):
        write_shard(tmp_path / "big.safetensors", [([1, 2], np.full((2, 2 * 576), 7e4), 1)],
                    ShardMeta((1, 2), 576, 49152))
    (tmp_path / "p.jsonl").write_text('{"question": "a"}\n{"problem": "b"}\n{"turns": ["c", "d"]}\n')
    assert sorted(load_prompts(str(tmp_path / "p.jsonl"))) == ["a", "b", "c"]
    args = build_parser().parse_args(["fit", "--target", "t.gguf", "--shards", "x", "--out", "o"])
    assert args.layers == 5 and args.block_size == 16


def test_hf_config_is_read_by_the_converters_reader():
    """Training reads a drafter's config.json with the converter's one reader
    (convert.config.parse_config): same lookup rule, same checks, same errors."""
    from convert.config import parse_config

    cfg = DFlash2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=300, num_target_layers=12,
                        target_layer_ids=(1, 9), mask_token_id=5, selector_top_k=7, conv_group_size=16,
                        layer_types=("sliding_attention", "full_attention"), sliding_window=8, is_causal=None)
    d = cfg.to_hf_dict()
    assert DFlash2Config.from_hf_dict(d) == cfg
    assert parse_config(d).selector_top_k == 7 and parse_config(d).sliding_window_pattern == (True, False)
    # no target_layer_ids: the authors' default of num_target_layers, for both readers
    d2 = {**d, "dflash_config": {k: v for k, v in d["dflash_config"].items() if k != "target_layer_ids"}}
    assert DFlash2Config.from_hf_dict(d2).target_layer_ids == parse_config(d2).target_layer_ids == (1, 9)
    # dflash_config.use_swa: every layer slides
    d3 = {**d, "layer_types": None, "dflash_config": {**d["dflash_config"], "use_swa": True, "swa_window_size": 4}}
    c3 = DFlash2Config.from_hf_dict(d3)
    assert (c3.layer_types, c3.sliding_window) == (("sliding_attention", "sliding_attention"), 4)
    with pytest.raises(ValueError, match="selector_top_k <= 7"):  # 64 < 8 * 9: one check, one message
        DFlash2Config.from_hf_dict({**d, "dflash_config": {**d["dflash_config"], "selector_top_k": 8}})
    with pytest.raises(ValueError, match="not a DFlash 2 drafter"):
        DFlash2Config.from_hf_dict({**d, "architectures": ["DFlashDraftModel"]})
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlash2Config.from_hf_dict({**d, "dflash_config": {**d["dflash_config"], "mask_token_id": None}})


def test_greedy_acceptance_equals_single_block_drafts():
    """The batched tau estimate == drafting each anchor with the inference helper ``draft``."""
    cfg = _tiny()
    m = random_drafter(cfg)
    g = torch.Generator().manual_seed(2)
    L = 30
    tok = torch.randint(0, V - 1, (2, L), generator=g)
    feat = torch.randn(2, L, 2 * H, generator=g)
    batch = O.Batch(tok, feat, torch.arange(L).expand(2, -1), torch.tensor([30, 20]), torch.tensor([2, 2]))
    anc = torch.tensor([[3, 10, 26], [5, 9, 17]])
    valid = torch.ones_like(anc, dtype=torch.bool)
    # make some drafts right: plant the drafter's own greedy path as the continuation
    for b, p in ((0, 10), (1, 5)):
        path, _, _ = m.draft(feat[b:b + 1, :p], tok[b, p:p + 1], p)
        tok[b, p + 1:p + 1 + 2] = path[0, :2]
    taus = O.greedy_acceptance(m, batch, 3, anchors=(anc, valid))
    want = []
    for b in range(2):
        for p in anc[b].tolist():
            path, _, _ = m.draft(feat[b:b + 1, :p], tok[b, p:p + 1], p)
            ok = (path[0] == tok[b, p + 1:p + cfg.block_size]).long().cumprod(0).sum()
            want.append(int(ok) + 1)
    assert taus.tolist() == want
    assert want[1] >= 3 and want[3] >= 3


def test_restricted_vocab_loss_equals_full_when_vocab_is_everything():
    """``dflash2_loss(vocab=...)``: with every id it is the full objective; with a subset the
    logits are the matching columns and labels outside the subset are not counted in the CE."""
    import torch

    from dflash2_gguf.train import objective as O
    from dflash2_gguf.train.model import DFlash2Config, DFlash2Drafter

    V, H = 300, 64
    cfg = DFlash2Config(hidden_size=H, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=V, num_target_layers=8,
                        target_layer_ids=(1, 3), mask_token_id=V - 1, block_size=4, selector_rank=8,
                        selector_top_k=5)
    torch.manual_seed(0)
    m = DFlash2Drafter(cfg)
    m.set_target_weights(torch.randn(V, H) * 0.5)
    b, n = 2, 40
    tokens = torch.randint(0, 50, (b, n))
    batch = O.Batch(tokens, torch.randn(b, n, 2 * H), torch.arange(n).repeat(b, 1),
                    torch.tensor([n, n - 5]), torch.tensor([5, 8]))
    anchors = O.sample_anchors(batch.lengths, batch.anchor_min, 6, torch.Generator().manual_seed(1))
    full = O.dflash2_loss(m, batch, 6, anchors=anchors)
    every = O.dflash2_loss(m, batch, 6, anchors=anchors, vocab=torch.arange(V))
    assert torch.allclose(full.loss, every.loss, atol=1e-6)
    assert torch.equal(full.correct, every.correct) and torch.equal(full.count, every.count)
    assert torch.equal(full.selector_correct, every.selector_correct)
    sub = O.dflash2_loss(m, batch, 6, anchors=anchors, vocab=torch.arange(50))  # all labels inside
    assert torch.isfinite(sub.loss) and sub.ce <= full.ce  # fewer competitors, lower CE
    sub.loss.backward()
    assert m.candidate_selector.successor_codebook.grad[50:].abs().sum() == 0


def test_read_responses_cut_and_damaged(tmp_path):
    """A recorded-answers file: later lines win, a last line cut by a killed run is skipped, a
    damaged earlier line is an error naming the line, gzip reads the same, a missing file is empty."""
    import gzip

    from dflash2_gguf.train.generate import read_responses

    rows = [{"i": 0, "prompt": [1, 2], "response": [3]}, {"i": 1, "prompt": [1], "response": [4, 5]},
            {"i": 0, "prompt": [1, 2], "response": [6, 7]}]
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"i": 2, "prompt": [1'
    (tmp_path / "r.jsonl").write_text(text)
    got = read_responses(tmp_path / "r.jsonl")
    assert sorted(got) == [0, 1] and got[0]["response"] == [6, 7] and got[1]["response"] == [4, 5]
    with gzip.open(tmp_path / "r.jsonl.gz", "wt") as f:
        f.write(text)
    assert read_responses(tmp_path / "r.jsonl.gz") == got
    assert read_responses(tmp_path / "missing.jsonl") == {}
    (tmp_path / "bad.jsonl").write_text('{"i": 0, "prompt": "text", "response": []}\n' + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        read_responses(tmp_path / "bad.jsonl")


def _planted_walk(m, cfg, n=40, plen=3, seed=3):
    """A sequence whose T=0 decode is known: from each anchor the drafter's own first j drafts
    are planted, then a token it did not draft (the target's correction, the next anchor)."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, V - 1, (n,), generator=g)
    feat = torch.randn(n, 2 * H, generator=g)
    want, p, js = [], plen, [2, 0, 3, 1]
    while p <= n - cfg.block_size:
        j = js[len(want) % len(js)]
        path, _, _ = m.draft(feat[None, :p], tok[p:p + 1], p)
        tok[p + 1:p + 1 + j] = path[0, :j]
        if j < cfg.block_size - 1:
            tok[p + 1 + j] = (path[0, j] + 1) % (V - 1)
        want.append(j + 1)
        p += j + 1
    return tok, feat, plen, want


def test_walk_acceptance_is_the_decode_of_a_planted_sequence(tmp_path):
    """walk_acceptance: the first pass drafts from the first answer token, each pass commits its
    accepted drafts plus the bonus token, the next pass starts at the bonus token; any chunking."""
    cfg = _tiny()
    m = random_drafter(cfg)
    tok, feat, plen, want = _planted_walk(m, cfg)
    assert len(want) >= 10 and set(want) == {1, 2, 3, 4}
    assert O.walk_acceptance(m, tok, feat, plen) == want
    assert O.walk_acceptance(m, tok, feat, plen, chunk=3) == want
    assert O.walk_acceptance(m, tok[:plen + cfg.block_size - 1], feat[:plen + cfg.block_size - 1], plen) == []
    # evaluate_walk over shards: per-sequence mean (bench's per-request tau) and pooled
    from dflash2_gguf.train.loop import evaluate_walk

    tok2, feat2, _, want2 = _planted_walk(m, cfg, n=30, seed=4)
    p = write_shard(tmp_path / "walk.safetensors", [(tok.tolist(), feat.numpy(), plen),
                                                     (tok2.tolist(), feat2.numpy(), plen)],
                    ShardMeta(cfg.target_layer_ids, cfg.hidden_size, cfg.vocab_size))
    ev = evaluate_walk(m, FeatureShards([p]))
    per = [sum(w) / len(w) for w in (want, want2)]
    assert ev["n_seqs"] == 2 and ev["n_passes"] == len(want) + len(want2)
    assert ev["walk_tau"] == pytest.approx(sum(per) / 2, abs=1e-6)
    assert ev["walk_tau_pooled"] == pytest.approx(sum(want + want2) / (len(want) + len(want2)), abs=1e-6)
    assert evaluate_walk(m, FeatureShards([p]), max_seqs=1)["n_passes"] == len(want)


def test_walk_step_anchors_land_where_the_next_pass_starts(tmp_path):
    """share 0: exactly the uniform draw; share 1: every uniform anchor a replaced by a + tau(a)
    (tau under the current weights), dropped past the last labelled row or when taken twice."""
    cfg = _tiny()
    m = random_drafter(cfg)
    tok, feat, plen, _ = _planted_walk(m, cfg)
    n = tok.shape[0]
    batch = O.Batch(tok[None], feat[None], torch.arange(n)[None], torch.tensor([n]), torch.tensor([plen]))
    uni = O.sample_anchors(batch.lengths, batch.anchor_min, 12, torch.Generator().manual_seed(5))
    same = O.walk_step_anchors(m, batch, 12, 0.0, torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(uni, same))
    anc, valid = O.walk_step_anchors(m, batch, 12, 1.0, torch.Generator().manual_seed(5))
    tau = O.anchor_acceptance(m, batch, *uni)[0]
    want = sorted({int(a + t) for a, t in zip(uni[0][0], tau) if a + t <= n - 2})
    assert anc[0][valid[0]].tolist() == want and want != sorted(uni[0][0].tolist())
    assert any(t > 1 for t in tau.tolist())
    half, ok = O.walk_step_anchors(m, batch, 12, 0.5, torch.Generator().manual_seed(5))
    picked = set(half[0][ok[0]].tolist())
    assert picked <= set(uni[0][0].tolist()) | set(want) and 6 <= len(picked) <= 12
    assert len(picked & set(uni[0][0].tolist())) >= 6  # the other half stays uniform
    with pytest.raises(ValueError, match="share must be in"):
        O.walk_step_anchors(m, batch, 12, 1.5)
    # and the loop trains with them, logging the decode-walk tau per family
    d = tmp_path
    s = _synthetic_shard(d / "s.safetensors", cfg)
    _, state = train(cfg, TrainConfig(shards=[str(s)], out_dir=str(d / "run"), steps=6, lr=3e-3,
                                      warmup_steps=1, batch_size=2, max_len=24, anchors_per_seq=4,
                                      log_every=3, save_every=100, progress=False, eval_shards=[str(s)],
                                      eval_batches=1, eval_walk_seqs=2, walk_anchor_share=0.5),
                     target_weights=(torch.randn(V, H) * 0.3, None))
    ev = [h for h in state.history if "walk_tau_by_family" in h]
    assert len(ev) == 1 and 1.0 <= ev[0]["walk_tau_by_family"]["all"] <= cfg.block_size
