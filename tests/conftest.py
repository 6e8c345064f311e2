"""Shared fixtures: pinned real models (fetched once, cached) and test-wide settings."""

from __future__ import annotations

import os

# Two cores and OpenMP spin barriers: a busy neighbour turns a 1 ms decode into 250 ms
# (DESIGN.md section 7). Must be set before libllama / libgomp load.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest  # noqa: E402

from dflash2_gguf import assets  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to the real SmolLM2-135M-Instruct Q4_1 GGUF (llama arch, hidden 576, 30 layers)."""
    return assets.fetch("smollm2-135m-instruct-q4_1")


@pytest.fixture(scope="session")
def qwen25_05b_gguf():
    """Path to the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2 arch, hidden 896)."""
    return assets.fetch("qwen2.5-coder-0.5b-instruct-q4_k_m")
