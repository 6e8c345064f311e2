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

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .params import PARAMS, table_fields

__all__ = ["SamplingParams", "apply_penalties", "processed_probs", "rejection_step", "residual"]


@dataclass(frozen=True)
@table_fields(group="sampling")
class SamplingParams:
    """Every sampling option of a generation, with its default; the one type that flows from the
    API, CLI and server to the native driver (``native/sampling.h``, ``SamplingOptions``).

    The fields come from the ``group="sampling"`` entries of :data:`dflash2_gguf.decoder.params.PARAMS`
    (type, default, flags, request fields, native field: declared there once). Adding an option:
    an entry there, a line in ``DFLASH2_SAMPLING_FIELDS`` (native/sampling.h) and its use in
    ``native/sampling.cpp``; its range check, if any, below.

    Defaults are llama-cpp-python's ``create_completion`` ones (llama-server's where it has no
    such option). The processed distribution applies, in llama.cpp's order
    (``common/sampling.cpp``): ``logit_bias`` -> repetition penalties -> ``grammar`` mask ->
    ``top_k`` -> ``top_p`` -> ``min_p`` -> ``temperature``.

    Attributes:
        temperature: Softmax temperature; ``0`` means greedy decoding (argmax of the processed
            logits: bias, penalties and grammar still apply).
        top_k: Keep the ``top_k`` most likely tokens; ``0`` disables.
        top_p: Nucleus sampling mass in ``(0, 1]``; ``1`` disables.
        min_p: Keep tokens with probability >= ``min_p`` times the top one; ``0`` disables.
        seed: Seed of the driver's RNG (xoshiro256**); ``None`` picks a random one per call.
        repeat_penalty: llama.cpp's ``--repeat-penalty`` (``1`` = off): a logit of a token in the
            window is divided by it when positive, multiplied when negative.
        repeat_last_n: The penalty window in tokens (``0`` = off, ``-1`` = the context size);
            llama.cpp's ``--repeat-last-n``.
        presence_penalty: Subtracted once from the logit of every token in the window (OpenAI
            ``presence_penalty``, llama.cpp ``--presence-penalty``).
        frequency_penalty: Subtracted per occurrence in the window (``--frequency-penalty``).
        penalize_prompt: Whether prompt tokens enter the penalty window. ``True`` is
            llama-server's behaviour (it feeds the prompt to its sampler); ``False`` is
            llama-cpp-python's ``Llama.create_completion`` (only generated tokens count).
        logit_bias: ``{token id: bias}`` added to the raw logits; ``-inf`` bans a token.
        grammar: A GBNF grammar (root rule ``root``, llama.cpp ``grammars/README.md``) the output
            must follow; see :func:`dflash2_gguf.chat.grammar.json_schema_to_grammar` for JSON schemas.
        n_probs: ``> 0``: report, for each generated token, its log-probability and the
            ``n_probs`` most likely tokens under the distribution after bias, penalties and
            grammar, before truncation and temperature (what llama-server's ``n_probs`` reports
            by default).
    """

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
        if not (self.repeat_penalty >= 0 and math.isfinite(self.repeat_penalty)):
            raise ValueError(f"repeat_penalty must be a finite number >= 0, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (-1 = context size, 0 = off), got {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")
        for tok, bias in (self.logit_bias or {}).items():
            if int(tok) < 0:
                raise ValueError(f"logit_bias token id must be >= 0, got {tok}")
            if math.isnan(float(bias)) or float(bias) == math.inf:
                raise ValueError(f"logit_bias of token {tok} must be a number < +inf (-inf bans it), got {bias}")
        if self.n_probs < 0:
            raise ValueError(f"n_probs must be >= 0, got {self.n_probs}")

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (``temperature == 0``)."""
        return self.temperature <= 0

    @classmethod
    def greedy_params(cls) -> "SamplingParams":
        """Greedy decoding (``temperature = 0``, every filter off)."""
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)

    def to_native(self, options_type: Any) -> Any:
        """The native ``SamplingOptions`` with every field set, each under its table entry's
        native name (``seed=None`` drawn here).

        Raises:
            TypeError: the native type lacks a field of this class (extension out of date:
                rebuild it with ``pip install --no-build-isolation -e .``).
        """
        o = options_type()
        for p in PARAMS:
            if p.group != "sampling":
                continue
            v = getattr(self, p.name)
            if p.name == "seed" and v is None:
                v = int.from_bytes(os.urandom(8), "little")
            elif p.name == "logit_bias":
                v = [(int(t), float(b)) for t, b in (v or {}).items()]
            elif p.name == "grammar":
                v = v or ""
            if not hasattr(o, p.native_field):
                raise TypeError(f"the native extension has no sampling option {p.native_field!r}: rebuild it "
                                "(pip install --no-build-isolation -e .)")
            setattr(o, p.native_field, v)
        return o


def apply_penalties(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """Logit bias and repetition penalties, as the driver applies them before truncation.

    Args:
        logits: ``[n_vocab]`` raw logits.
        params: Sampling parameters (``logit_bias``, ``repeat_penalty``, ``repeat_last_n``,
            ``presence_penalty``, ``frequency_penalty``).
        history: The tokens before this position that the window sees (the prompt first when
            ``params.penalize_prompt``, then the generated tokens); only the last
            ``repeat_last_n`` count (all of them when ``-1``).

    Returns:
        ``[n_vocab]`` float32 logits. The penalty formula is llama.cpp's
        (``src/llama-sampler.cpp``, ``llama_sampler_penalties_apply`` at 0c1e570).
    """
    x = np.array(logits, dtype=np.float32)
    for tok, bias in (params.logit_bias or {}).items():
        x[int(tok)] += np.float32(bias)
    rp, fp, pp, last_n = params.repeat_penalty, params.frequency_penalty, params.presence_penalty, params.repeat_last_n
    on = last_n != 0 and ((rp not in (0.0, 1.0)) or pp != 0.0 or fp != 0.0)
    if on and len(history):
        window = list(history) if last_n < 0 else list(history)[-last_n:]
        tok, cnt = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        for t, c in zip(tok, cnt):
            v = x[t]
            if rp != 0.0:
                v = v * np.float32(rp) if v <= 0 else v / np.float32(rp)
            x[t] = np.float32(v) - (np.float32(c) * np.float32(fp) + np.float32(pp))
    return x


def processed_probs(logits: np.ndarray, params: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """The distribution the driver samples from, for one row of logits (no grammar).

    Args:
        logits: ``[n_vocab]`` float array (raw target logits).
        params: Sampling parameters with ``temperature > 0``.
        history: Tokens the penalty window sees before this position (see
            :func:`apply_penalties`); ignored without penalties.

    Returns:
        ``[n_vocab]`` float64 probabilities summing to 1; removed tokens are exactly 0.
        Order of filters and tie-breaking (higher logit first, then lower id) as in the driver.
    """
    if params.temperature <= 0:
        raise ValueError("processed_probs needs temperature > 0 (temperature 0 is argmax)")
    x = apply_penalties(logits, params, history).astype(np.float64)
    n = x.shape[-1]
    order = np.lexsort((np.arange(n), -x))  # descending logit, ascending id on ties
    keep = order[x[order] > -np.inf]  # banned by logit_bias
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
