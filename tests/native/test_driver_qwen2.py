"""A real qwen2 target (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 24 layers, hidden 896) goes through
the cb_eval capture path (qwen2's graph records no layer inputs) with a matching random DFlash 2
drafter converted by our converter.

T = 0 check: token-for-token equality with the target alone through ``llama_cpp.Llama`` (greedy,
one-token decodes), no tolerance. K-quant weights need two llama.cpp settings for a row of a
batched pass (our verification) to get the same logits bit for bit as a one-token decode, on
both sides: no CPU weight repacking (``repack=False``, llama.cpp's ``--no-repack``; repacked
Q4_K weights use a gemv kernel for one row and a gemm kernel for several) and no tiled K-quant
matmul (``GGML_CPU_TILED_MM=0``, read once per process by ggml, so the check runs in a
subprocess); flash attention on and contexts within 256 cells as in test_driver_smollm2.py.
Measured on this build (a probe on the first 4 prompts, 64 tokens): without
``GGML_CPU_TILED_MM=0``, 1 of 4 departs at token 51; with repacking, logits of the two passes
differ by up to 0.7 at the first generated token.

``slow``: the target is a 491 MB download on first use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


pytestmark = [pytest.mark.native, pytest.mark.slow]

PROMPTS = ["def quicksort(arr):", "# Read a CSV file with pandas\n", "SELECT name, age FROM users WHERE",
           "The capital of France is", "import torch\n\nclass MLP(torch.nn.Module):", "Write a haiku about rust."]
N_NEW = 64


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


def _run_pair(target: str, drafter: str) -> list[dict]:
    """In this (sub)process: per prompt, our greedy tokens with the drafter and Llama's alone."""
    import llama_cpp
    from llama_cpp import llama_cpp as capi

    from dflash2_gguf import DFlashDecoder, SamplingParams

    default_params = capi.llama_model_default_params

    def no_repack():      # Llama() has no keyword for use_extra_bufts
        p = default_params()
        p.use_extra_bufts = False
        return p

    capi.llama_model_default_params = no_repack
    llm = llama_cpp.Llama(target, n_ctx=512, n_threads=2, n_threads_batch=2, flash_attn=True, verbose=False)
    capi.llama_model_default_params = default_params
    out = []
    from tiny_models import FLAT_COSTS

    with DFlashDecoder(target, drafter, n_ctx=512, n_threads=2, flash_attn=True, repack=False,
                       cost_model=FLAT_COSTS) as dec:
        assert dec.capture_path == "cb_eval" and dec.drafter_version == 2
        for text in PROMPTS:
            ids = dec.tokenize(text)
            ref: list = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
                ref.append(int(tok))
                if len(ref) == N_NEW:
                    break
            r = dec.generate(ids, max_tokens=N_NEW, sampling=SamplingParams.greedy_params(), ignore_eos=True)
            out.append(dict(prompt=text, n_prompt=len(ids), ours=list(r.tokens), ref=ref,
                            n_drafted=r.stats.n_drafted, n_cycles=r.stats.n_cycles))
    return out


def test_qwen2_cb_eval_greedy_equals_llama_cpp(native_ext, qwen25_05b_gguf, qwen2_drafter):
    env = dict(os.environ, GGML_CPU_TILED_MM="0")
    p = subprocess.run([sys.executable, __file__, str(qwen25_05b_gguf), str(qwen2_drafter)], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(rows) == len(PROMPTS)
    for r in rows:
        assert r["n_prompt"] + N_NEW <= 256
        assert len(r["ours"]) == N_NEW and r["n_drafted"] >= r["n_cycles"] > 0
        j = next((j for j, (a, b) in enumerate(zip(r["ours"], r["ref"])) if a != b), None)
        assert j is None and len(r["ref"]) == N_NEW, f"{r['prompt']!r}: departs at token {j}"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
    print(json.dumps(_run_pair(sys.argv[1], sys.argv[2])))
