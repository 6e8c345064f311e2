"""Shared fixtures: pinned real models (fetched once, cached) and test-wide settings."""

from __future__ import annotations

import os

# Two cores and OpenMP spin barriers: a busy neighbour turns a 1 ms decode into 250 ms
# (measured on a 2-core machine). Must be set before libllama / libgomp load.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest  # noqa: E402

# Cost models and learnt draft policies the tests produce (many keyed by temporary drafters) go
# to a file of this test session, not to the user's ~/.cache/dflash2-gguf/cost-models.json, and
# no test starts from what the user's own runs learnt. Inherited by the servers tests start.
if "DFLASH2_GGUF_COST_MODELS" not in os.environ:
    import tempfile

    os.environ["DFLASH2_GGUF_COST_MODELS"] = os.path.join(
        tempfile.mkdtemp(prefix="dflash2-gguf-cost-models-"), "cost-models.json")

from dflash2_gguf import assets  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (llama arch, hidden 576, 30 layers)."""
    return assets.fetch("smollm2-135m-instruct-q4_1")


@pytest.fixture(scope="session")
def qwen25_05b_gguf():
    """Path to the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2 arch, hidden 896)."""
    return assets.fetch("qwen2.5-coder-0.5b-instruct-q4_k_m")


# ---------------------------------------------------------------------------- driver fixtures
# Tiny targets and drafters (built once per session), random SmolLM2 drafters converted with our
# converter, and the native-extension skip.

from tiny_models import tiny_drafter, write_tiny_target  # noqa: E402


def _need_native():
    try:
        from dflash2_gguf._native_loader import native

        native()
    except ImportError as e:  # pragma: no cover - depends on the build
        pytest.skip(f"native extension unavailable: {e}")


@pytest.fixture(scope="session")
def native_ext():
    _need_native()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir):
    """Tiny random F32 llama target (hidden 288, 4 layers, vocab 48): layer-input path."""
    return write_tiny_target(tiny_dir / "tiny_llama.gguf", arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_dir):
    """Tiny random F32 qwen2 target (same sizes): cb_eval path."""
    return write_tiny_target(tiny_dir / "tiny_qwen2.gguf", arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_drafters(tiny_dir, tiny_llama):
    """{1: v1 GGUF, 2: v2 GGUF}: random F32 drafters (1 layer, block 6) for the tiny targets."""
    return {v: tiny_drafter(tiny_dir / f"d{v}", tiny_llama, version=v, seed=v) for v in (1, 2)}


@pytest.fixture(scope="session")
def tiny_peaked(tiny_dir):
    """Tiny llama target whose argmax is often token 7, plus {1: v1, 2: v2} random drafters that
    then agree with it often (tests/native/test_driver.py counts the accepted drafts): (target,
    drafters). Its matrices are Q4_1, as the SmolLM2 target's: the greedy-equality tests on it
    need one-token and batched passes with bit-identical logits, which F32 weights do not give
    on every CPU (tiny_models.py)."""
    t = write_tiny_target(tiny_dir / "tiny_peaked.gguf", arch="llama", peak=6.0, seed=2, weights="q4_1")
    return t, {v: tiny_drafter(tiny_dir / f"p{v}", t, version=v, seed=10 + v) for v in (1, 2)}


@pytest.fixture(scope="session")
def smollm2_drafters(tmp_path_factory, smollm2_gguf):
    """{1: v1, 2: v2}: random 2-layer SmolLM2 drafters (hidden 576, block 8), q8_0, converted
    with our converter from checkpoints in the authors' format."""
    from checkpoints import make_dflash_checkpoint
    from convert import convert_hf_to_gguf

    root = tmp_path_factory.mktemp("smol_drafters")
    out = {}
    for v in (1, 2):
        ck = make_dflash_checkpoint(root / f"hf_v{v}", version=v, seed=v)
        out[v] = convert_hf_to_gguf(ck, smollm2_gguf, root / f"smol_v{v}.gguf", outtype="q8_0", force=True)
    return out


@pytest.fixture(scope="session")
def qwen25_drafter(tmp_path_factory, qwen25_05b_gguf):
    """A random 2-layer DFlash 2 drafter for Qwen2.5-Coder-0.5B (hidden 896, target layers 1/11/20
    of 24, block 8, the target GGUF's vocabulary), q8_0, converted with our converter from a
    checkpoint in the authors' format (no trained drafter exists for this target)."""
    from checkpoints import make_dflash_checkpoint
    from convert import convert_hf_to_gguf

    from dflash2_gguf.server.context import read_model_info

    root = tmp_path_factory.mktemp("qwen25_drafter")
    ck = make_dflash_checkpoint(root / "hf", version=2, hidden_size=896, intermediate_size=1536, num_layers=2,
                                num_heads=14, num_kv_heads=2, head_dim=64,
                                vocab_size=read_model_info(qwen25_05b_gguf).n_vocab,
                                target_layer_ids=(1, 11, 20), num_target_layers=24, block_size=8, seed=5,
                                selector_rank=64)
    return convert_hf_to_gguf(ck, qwen25_05b_gguf, root / "qwen25_v2.gguf", outtype="q8_0", force=True)
