"""Sampling parameters and the sampling math of the driver, as pure numpy functions.

The native driver (``native/driver.cpp``) does this math in C++ on the hot path; the functions
here are its documented twins, used as test oracles and by code that wants the exact target
distribution (no build needed).

Processed distribution (:func:`processed_probs`), in llama.cpp's sampler-chain order
(``src/llama-sampler.cpp`` at 0c1e570, the chain llama-cpp-python builds for
``Llama.create_completion``): ``top_k`` -> ``top_p`` -> ``min_p`` -> ``temperature``. ``top_p``
and ``min_p`` therefore act on the temperature-1 probabilities of the tokens that survived the
previous filters; the temperature only reshapes the survivors. ``temperature == 0`` is greedy
(argmax, first maximum on ties).

Lossless verification (:func:`rejection_step`; Leviathan et al. 2023, Chen et al. 2023; dflash
0.1.0 ``_rejection_sample``): a draft ``d`` drawn from ``q`` is accepted when ``u * q(d) < p(d)``
with ``u ~ U[0, 1)``; at the first rejection the replacement token is drawn from
``max(p - q, 0) / sum(max(p - q, 0))``, or from ``p`` when that residual is all zero. For DFlash 2,
``q`` is ``softmax(S / T)`` over the selector's ``k`` candidates along the sampled path
(zero elsewhere); for DFlash 1 it is the drafter's processed distribution with the same
parameters as the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["SamplingParams", "processed_probs", "rejection_step", "residual"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters, named and defaulted as in llama-cpp-python's ``create_completion``.

    Attributes:
        temperature: Softmax temperature; ``0`` means greedy decoding (argmax).
        top_k: Keep the ``top_k`` most likely tokens; ``0`` disables.
        top_p: Nucleus sampling mass in ``(0, 1]``; ``1`` disables.
        min_p: Keep tokens with probability >= ``min_p`` times the top one; ``0`` disables.
        seed: Seed of the driver's RNG (xoshiro256**); ``None`` picks a random one per call.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= int(self.seed) < 2**64):
            raise ValueError("seed must be in [0, 2**64)")

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (``temperature == 0``)."""
        return self.temperature <= 0

    @classmethod
    def greedy_params(cls) -> "SamplingParams":
        """Greedy decoding (``temperature = 0``, every filter off)."""
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)


def processed_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the driver samples from, for one row of logits.

    Args:
        logits: ``[n_vocab]`` float array (raw target logits).
        params: Sampling parameters with ``temperature > 0``.

    Returns:
        ``[n_vocab]`` float64 probabilities summing to 1; removed tokens are exactly 0.
        Order of filters and tie-breaking (higher logit first, then lower id) as in the driver.
    """
    if params.temperature <= 0:
        raise ValueError("processed_probs needs temperature > 0 (temperature 0 is argmax)")
    x = np.asarray(logits, dtype=np.float64)
    n = x.shape[-1]
    order = np.lexsort((np.arange(n), -x))  # descending logit, ascending id on ties
    keep = order
    if 0 < params.top_k < n:
        keep = keep[: params.top_k]
    if params.top_p < 1.0:
        z = np.exp(x[keep] - x[keep[0]])
        cum = np.cumsum(z / z.sum())
        hit = np.nonzero(cum >= params.top_p)[0]
        keep = keep[: (hit[0] + 1) if hit.size else keep.size]
    mx = x[keep].max()
    if params.min_p > 0:
        keep = keep[x[keep] >= mx + np.log(np.float32(params.min_p))]
    out = np.zeros(n, dtype=np.float64)
    e = np.exp((x[keep] - mx) / params.temperature)
    out[keep] = e / e.sum()
    return out


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``max(p - q, 0)`` renormalized; ``p`` itself when the residual is all zero."""
    r = np.clip(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64), 0, None)
    s = r.sum()
    return r / s if s > 0 else np.asarray(p, dtype=np.float64) / np.sum(p)


def rejection_step(draft: int, p: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> tuple[bool, int]:
    """One position of lossless speculative verification.

    Args:
        draft: The drafted token id, drawn from ``q``.
        p: ``[n_vocab]`` target processed distribution at this position.
        q: ``[n_vocab]`` distribution the draft was drawn from (``q[draft] > 0``).
        rng: numpy Generator.

    Returns:
        ``(accepted, token)``: ``token`` is ``draft`` when accepted, else a draw from
        :func:`residual`. Marginally, ``token ~ p`` whatever ``q`` is.
    """
    u = rng.random()
    if u * q[draft] < p[draft]:
        return True, int(draft)
    r = residual(p, q)
    return False, int(rng.choice(r.shape[0], p=r))
