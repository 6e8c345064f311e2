"""Parity with the authors' PyTorch reference (PyPI ``dflash==0.1.0``).

For a fixed context and fixed target features (captured from libllama on a tiny F32 llama
target), one full-block draft pass of our driver (upstream's ``dflash`` graph in libllama, F32
drafter GGUF from our converter, F32 drafter K/V, flash attention off) is compared with
``DFlash2DraftModel`` / ``DFlashDraftModel`` on the same weights (the HF checkpoint the GGUF was
converted from), fed the same features, the target's token embeddings and output head:

- draft logits of every block row (anchor row included): ``|ours - ref| <= 1e-3 + 1e-3 * |ref|``
  (observed ~1e-5: float32 both sides, different summation orders);
- DFlash 2: the candidate set of every row, and the selector lattice ``S_t(a, b)`` for every
  predecessor slot ``a`` and candidate ``b`` after aligning both by token id, same tolerance;
- the greedy path (v2: lattice walk vs ``propose(temperature=0)``; v1: argmax of rows 1..).

Measured when these tests were written: each wrong convention (no k_norm on context keys, positions off by one,
causal block, conv wrapping at row 0, HF id without +1) moves these by 0.2 to 7.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiny_models import MASK_ID, read_tensor

pytestmark = pytest.mark.native

ATOL = 1e-3
RTOL = 1e-3


@pytest.fixture(scope="module")
def parity_drafters(tiny_dir, tiny_llama):
    """{1: GGUF, 2: GGUF} F32 drafters for the tiny target. The v2 selector codebooks are scaled
    x30 (std 0.6) so the bilinear term of S is O(1): with the checkpoints' default std 0.02 it
    would be ~1e-4 and a wrong predecessor alignment could hide inside the tolerance."""
    from safetensors.numpy import load_file

    from checkpoints import write_safetensors
    from convert import convert_hf_to_gguf
    from tiny_models import tiny_drafter

    out = {1: tiny_drafter(tiny_dir / "par1", tiny_llama, version=1, seed=21)}
    g = tiny_drafter(tiny_dir / "par2", tiny_llama, version=2, seed=22)
    ck = g.parent / "hf_v2"
    t = load_file(str(ck / "model.safetensors"))
    for k in ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"):
        t[k] = t[k] * 30.0
    write_safetensors(ck / "model.safetensors", t, dtype="float32")
    out[2] = convert_hf_to_gguf(ck, tiny_llama, g.parent / "scaled_v2.gguf", outtype="f32", force=True)
    return out


def _reference(version, ck_dir):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model_mod = pytest.importorskip("dflash.model")
    cls = model_mod.DFlash2DraftModel if version == 2 else model_mod.DFlashDraftModel
    return torch, cls.from_pretrained(str(ck_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("ctx_len, anchor", [(9, 17), (23, 40)])
def test_draft_pass_matches_reference(native_ext, tiny_llama, parity_drafters, version, ctx_len, anchor):
    from dflash2_gguf import DFlashDecoder

    ck_dir = parity_drafters[version].parent / f"hf_v{version}"
    torch, ref = _reference(version, ck_dir)
    rng = np.random.default_rng(ctx_len)
    ids = [1] + rng.integers(4, 48, size=ctx_len - 1).tolist()

    with DFlashDecoder(tiny_llama, parity_drafters[version], n_ctx=128, n_threads=1, flash_attn=False,
                       kv_f32_draft=True) as dec:
        feats = dec.engine.capture_features(ids)                       # [n, 2 * 288] float32
        logits, lattice, greedy = dec.engine.draft_from_features(feats, anchor)
        bs, K = dec.block_size, dec.engine.selector_top_k
    assert logits.shape == (bs, 48)

    emb = torch.from_numpy(read_tensor(tiny_llama, "token_embd.weight"))
    head_w = torch.from_numpy(read_tensor(tiny_llama, "output.weight"))

    def head(h):
        return h @ head_w.T

    block = torch.tensor([anchor] + [MASK_ID] * (bs - 1))
    with torch.no_grad():
        hidden = ref(position_ids=torch.arange(ctx_len + bs)[None], noise_embedding=emb[block][None],
                     target_hidden=torch.from_numpy(np.ascontiguousarray(feats))[None])   # [1, bs, H]
        ref_logits = ref.compute_logits(hidden, head)[0].numpy()
    print(f"v{version} n={ctx_len}: max |logits - ref| = {np.abs(logits - ref_logits).max():.2e}")
    np.testing.assert_allclose(logits, ref_logits, atol=ATOL, rtol=RTOL)

    if version == 1:
        assert greedy.tolist() == ref_logits[1:].argmax(-1).tolist()
        assert lattice is None
        return

    sel = ref.candidate_selector
    with torch.no_grad():
        path, _, _ = ref.propose(hidden[:, 1:], torch.tensor([anchor]), head, 0.0)
        assert greedy.tolist() == path[0].tolist()
        lg = torch.from_numpy(ref_logits)
        hp = sel.hidden_projection(hidden[0])                          # [bs, rank]
        prev_ids = torch.tensor([anchor])
        our_prev = None
        for i in range(1, bs):
            row = lattice[i]
            ours_c = row[:K].astype(np.int64)
            S_ours = row[K:K + K * K].reshape(K, K)                     # [pred slot, cand slot]
            unary, cand = torch.topk(lg[i], K)
            assert sorted(ours_c.tolist()) == sorted(cand.tolist()), f"row {i}: candidate sets differ"
            A = sel.predecessor_codebook(prev_ids)                      # [n_pred, rank]
            B = sel.successor_codebook(cand)                            # [K, rank]
            S_ref = unary[None, :] + (A * hp[i][None]) @ B.T            # [n_pred, K]
            # align candidate columns by id
            col = [int(np.nonzero(ours_c == c)[0][0]) for c in cand.tolist()]
            if i == 1:  # every predecessor slot repeats the anchor's scores
                for a in range(K):
                    np.testing.assert_allclose(S_ours[a, col], S_ref[0].numpy(), atol=ATOL, rtol=RTOL)
            else:       # predecessor slots follow our previous row's candidate order
                rows = [int(np.nonzero(prev_ids.numpy() == c)[0][0]) for c in our_prev.tolist()]
                np.testing.assert_allclose(S_ours[:, col], S_ref[rows].numpy(), atol=ATOL, rtol=RTOL)
                print(f"  row {i}: max |S - ref| = {np.abs(S_ours[:, col] - S_ref[rows].numpy()).max():.2e}")
            bil = (A * hp[i][None]) @ B.T
            assert float(bil.abs().max()) > 0.1, "the bilinear term must be visible at this tolerance"
            our_prev = ours_c
            prev_ids = cand
        assert np.all(lattice[0] == 0)
