"""Statistics of ``dflash2-gguf bench``: per-pass commits, per-request results and their summary.

Pure functions over plain data (no native code): tau (tokens committed per target verification
pass, bonus included, as the DFlash papers report it), the histogram of commits per pass,
per-position conditional acceptance, tokens/s and the speedup ratios.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["committed_per_pass", "RequestResult", "run_dict", "ratio", "summarize", "nan_to_none",
           "first_mismatch"]


def committed_per_pass(from_draft: Sequence[bool]) -> list:
    """Tokens committed by each verification pass, read from a result's ``from_draft`` flags.

    The first token comes from the prefill; each pass then commits its accepted drafts (True)
    and the target's own token (False). A last pass cut short by the budget, EOG or a stop
    string may end on drafts without its own token.
    """
    out, run = [], 0
    for fd in list(from_draft)[1:]:
        if fd:
            run += 1
        else:
            out.append(run + 1)
            run = 0
    if run:
        out.append(run)
    return out


@dataclass
class RequestResult:
    """One request (one generation = one turn) run with and without the drafter.

    Attributes:
        prompt_index / turn: Which prompt (in pick order) and which of its turns.
        n_prompt: Prompt tokens.
        base / spec: Per run: ``n_generated``, ``t_total_s``, ``t_prefill_s``, ``tokens_per_second``,
            ``decode_tokens_per_second``, ``stop_reason``; spec also ``n_cycles``, ``n_drafted``,
            ``n_accepted``, ``acceptance_length``, ``pos_reached``, ``pos_accepted``, ``committed``
            (tokens per pass).
        tokens_equal: Both runs produced the same tokens.
        first_mismatch: Index of the first differing token (None when equal).
    """

    prompt_index: int
    turn: int
    n_prompt: int
    base: dict
    spec: dict
    tokens_equal: bool
    first_mismatch: Optional[int]


def run_dict(res, with_spec: bool) -> dict:
    """One run's figures from a :class:`~dflash2_gguf.decoder.api.GenerationResult`: counts, times and
    tokens/s; the text for the target-alone run, the drafter's counters and per-pass commits for
    the run with the drafter (the ``base`` / ``spec`` dicts of :class:`RequestResult`)."""
    st = res.stats
    d = dict(n_generated=st.n_generated, t_total_s=st.t_total_s, t_prefill_s=st.t_prefill_s,
             tokens_per_second=st.tokens_per_second, decode_tokens_per_second=st.decode_tokens_per_second,
             stop_reason=st.stop_reason, n_cycles=st.n_cycles, n_cached=st.n_cached)
    if not with_spec:
        d["text"] = res.text
    else:
        d.update(n_drafted=st.n_drafted, n_accepted=st.n_accepted, acceptance_length=st.acceptance_length,
                 pos_reached=list(st.pos_reached), pos_accepted=list(st.pos_accepted),
                 committed=committed_per_pass(res.from_draft), t_target_s=st.t_target_s,
                 t_draft_s=st.t_draft_s, t_inject_s=st.t_inject_s, t_sample_s=st.t_sample_s)
    return d


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN when ``b`` is 0."""
    return a / b if b else float("nan")


def summarize(requests: Sequence[RequestResult], block_size: int) -> dict:
    """Pool per-request results into the figures of the report.

    Returns a dict with ``n_requests``, ``acceptance_length`` (mean over requests of each
    request's tau), ``acceptance_length_pooled`` (all committed tokens / all passes),
    ``acceptance_histogram`` (``{committed: passes}`` for 1..block_size), ``per_position_acceptance``,
    ``pos_reached``/``pos_accepted``, tokens/s of both runs (``*_tokens_per_second``: all tokens /
    all time, prefill included; ``*_decode_tokens_per_second``: prefill excluded), ``speedup``
    and ``decode_speedup`` (time per output token without / with the drafter), and the T=0
    check ``mismatches`` (requests whose tokens differ).
    """
    n_pos = max(block_size - 1, max((len(r.spec["pos_reached"]) for r in requests), default=0))
    reached, accepted = [0] * n_pos, [0] * n_pos
    hist = {k: 0 for k in range(1, max(block_size, 1) + 1)}
    taus = []
    for r in requests:
        s = r.spec
        if s["n_cycles"]:
            taus.append(s["acceptance_length"])
        for i, (a, b) in enumerate(zip(s["pos_accepted"], s["pos_reached"])):
            accepted[i] += a
            reached[i] += b
        for c in s["committed"]:
            hist[c] = hist.get(c, 0) + 1

    def agg(key: str) -> dict:
        n = sum(r.__dict__[key]["n_generated"] for r in requests)
        t = sum(r.__dict__[key]["t_total_s"] for r in requests)
        n_dec = sum(r.__dict__[key]["n_generated"] - 1 for r in requests)
        t_dec = sum(r.__dict__[key]["t_total_s"] - r.__dict__[key]["t_prefill_s"] for r in requests)
        return dict(n=n, t=t, n_dec=n_dec, t_dec=t_dec)

    b, s = agg("base"), agg("spec")
    passes = sum(r.spec["n_cycles"] for r in requests)
    committed = sum(sum(r.spec["committed"]) for r in requests)
    return {
        "n_requests": len(requests),
        "acceptance_length": (sum(taus) / len(taus)) if taus else float("nan"),
        "acceptance_length_pooled": ratio(committed, passes),
        "acceptance_histogram": hist,
        "per_position_acceptance": [(a / r) if r else float("nan") for a, r in zip(accepted, reached)],
        "pos_reached": reached,
        "pos_accepted": accepted,
        "n_cycles": passes,
        "n_drafted": sum(r.spec["n_drafted"] for r in requests),
        "n_accepted": sum(r.spec["n_accepted"] for r in requests),
        "base_tokens": b["n"], "spec_tokens": s["n"],
        "base_tokens_per_second": ratio(b["n"], b["t"]),
        "spec_tokens_per_second": ratio(s["n"], s["t"]),
        "base_decode_tokens_per_second": ratio(b["n_dec"], b["t_dec"]),
        "spec_decode_tokens_per_second": ratio(s["n_dec"], s["t_dec"]),
        "speedup": ratio(ratio(b["t"], b["n"]), ratio(s["t"], s["n"])),
        "decode_speedup": ratio(ratio(b["t_dec"], b["n_dec"]), ratio(s["t_dec"], s["n_dec"])),
        "mismatches": sum(0 if r.tokens_equal else 1 for r in requests),
    }


def nan_to_none(x: Any) -> Any:
    """``x`` with every NaN float (nested in dicts / lists) replaced by None: JSON-ready."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [nan_to_none(v) for v in x]
    return x


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length when one is a
    prefix of the other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
