"""A real qwen2 target (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 24 layers, hidden 896) goes through
the cb_eval capture path (qwen2's graph records no layer inputs) with a matching random DFlash 2
drafter converted by our converter.

T = 0 check, teacher-forced: every generated token is the argmax of the target's logits after a
full batched pass over prompt + the tokens before it. (A one-token-at-a-time reference would
differ from ANY batched verifier in the last bits of the K-quant CPU kernels and flip near-ties,
see test_driver_smollm2.py; batched passes agree with each other.)

``slow``: the target is a 491 MB download on first use.
"""

from __future__ import annotations

import numpy as np
import pytest


pytestmark = [pytest.mark.native, pytest.mark.slow]


@pytest.fixture(scope="module")
def qwen2_drafter(tmp_path_factory, qwen25_05b_gguf):
    from checkpoints import make_dflash_checkpoint
    from convert import convert_hf_to_gguf
    from dflash2_gguf import DFlashDecoder

    with DFlashDecoder(qwen25_05b_gguf, None, n_ctx=64, n_threads=2) as d:
        n_vocab = d.n_vocab
    root = tmp_path_factory.mktemp("qwen2_drafter")
    ck = make_dflash_checkpoint(root / "hf", version=2, hidden_size=896, intermediate_size=1536, num_layers=1,
                                num_heads=14, num_kv_heads=2, head_dim=64, vocab_size=n_vocab,
                                target_layer_ids=(1, 11, 20), num_target_layers=24, block_size=8, seed=3)
    return convert_hf_to_gguf(ck, qwen25_05b_gguf, root / "qwen2_v2.gguf", outtype="q8_0", force=True)


def test_qwen2_cb_eval_greedy_teacher_forced(native_ext, qwen25_05b_gguf, qwen2_drafter):
    from dflash2_gguf import DFlashDecoder, SamplingParams

    g = SamplingParams.greedy_params()
    n_new = 24
    with DFlashDecoder(qwen25_05b_gguf, qwen2_drafter, n_ctx=512, n_threads=2, flash_attn=False) as dec:
        assert dec.capture_path == "cb_eval" and dec.drafter_version == 2
        for text in ("def quicksort(arr):", "# Read a CSV file with pandas\n"):
            ids = dec.tokenize(text)
            spec = dec.generate(ids, max_tokens=n_new, sampling=g, ignore_eos=True)
            assert len(spec.tokens) == n_new and spec.stats.n_drafted >= spec.stats.n_cycles
            logits = dec.engine.target_logits(ids + spec.tokens[:-1])   # one batched pass
            forced = np.argmax(logits[len(ids) - 1:], axis=-1).tolist()
            # the last token may come from a one-row verify (budget left no room for drafts)
            assert forced[:-1] == spec.tokens[:-1]
