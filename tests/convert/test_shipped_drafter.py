"""The drafter shipped in ``models/`` (issue 4): the file its metadata describes, paired with the
default target, and still drafting well: acceptance length on GSM8K test prompts well above the
untrained drafter's 1.0.

``models/smollm2-135m-dflash2.json`` records how the file was made and measured (command, data,
steps, held-out figures) and its size and sha256, which are checked here byte for byte. The
drafter's HF checkpoint (``models/SmolLM2-135M-DFlash2``, the authors' layout) converts to that
exact file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest


MODELS = Path(__file__).resolve().parents[2] / "models"
GGUF = MODELS / "smollm2-135m-dflash2.gguf"
META = MODELS / "smollm2-135m-dflash2.json"
HF = MODELS / "SmolLM2-135M-DFlash2"


def test_file_matches_its_metadata():
    meta = json.loads(META.read_text())
    data = GGUF.read_bytes()
    assert len(data) == meta["bytes"] <= 40 * 2**20
    assert hashlib.sha256(data).hexdigest() == meta["sha256"]
    for key in ("command", "training", "held_out"):
        assert key in meta, key


def test_hf_checkpoint_converts_to_the_shipped_file(smollm2_gguf, tmp_path):
    from convert import convert_hf_to_gguf

    meta = json.loads(META.read_text())
    assert hashlib.sha256((HF / "model.safetensors").read_bytes()).hexdigest() == meta["hf_checkpoint"]["sha256"]
    out = convert_hf_to_gguf(HF, smollm2_gguf, tmp_path / "drafter-q8_0.gguf", outtype="q8_0")
    assert out.read_bytes() == GGUF.read_bytes()


def test_pairs_with_the_default_target(smollm2_gguf):
    from convert import inspect_gguf

    info = inspect_gguf(GGUF, target=smollm2_gguf)
    layers = json.loads(META.read_text())["drafter"]["layers"]
    assert info["architecture"] == "dflash" and info["version"] == "v2"
    assert info["fits"] and info["reasons"] == []
    assert info["target_layers_hf"] == [1, 14, 27]
    assert info["keys"]["dflash.block_count"] == layers == 5 and info["mask_token_id"] == 0


@pytest.mark.native
def test_acceptance_on_gsm8k_test_prompts(native_ext, smollm2_gguf):
    """3 GSM8K test prompts x 64 new tokens at T=0: acceptance length (bonus included, pooled)
    at least 1.8, where the untrained drafter of the same shape gets 1.0."""
    from dflash2_gguf.decoder.api import DFlashDecoder
    from dflash2_gguf.bench.cli import load_prompts

    committed = passes = 0
    with DFlashDecoder(smollm2_gguf, GGUF, n_ctx=1024, n_threads=2) as dec:
        for turns in load_prompts("gsm8k", 3):
            r = dec.generate(messages=[{"role": "user", "content": turns[0]}], max_tokens=64,
                             temperature=0.0, adaptive=False)  # the drafter's own acceptance
            committed += r.stats.n_generated - 1    # the prefill's token is not a pass
            passes += r.stats.n_cycles
    assert passes > 0
    assert committed / passes >= 1.8, f"pooled acceptance length {committed / passes:.3f}"
