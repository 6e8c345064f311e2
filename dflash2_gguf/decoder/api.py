"""Python API of the DFlash / DFlash 2 speculative decoder on GGUF files.

Layering (after mlx-lm's ``generate.py``): the native driver runs the whole loop in C++
(``Engine.begin`` = prefill + first token, ``Engine.step`` = one draft/verify cycle,
``Engine.generate`` = all cycles without returning to Python); :meth:`DFlashDecoder.stream`
turns cycles into :class:`StreamChunk` objects with text deltas; :meth:`DFlashDecoder.generate`
returns one :class:`GenerationResult`. The same code path runs with or without a drafter
(``drafter=None`` or ``use_drafter=False``), which is what the speedup figures compare.

Example::

    from dflash2_gguf import DFlashDecoder, SamplingParams
    with DFlashDecoder("target.gguf", "drafter.gguf", n_ctx=4096) as dec:
        res = dec.generate("The capital of France is", max_tokens=64,
                           sampling=SamplingParams(temperature=0))
        print(res.text, res.stats.acceptance_length, res.stats.tokens_per_second)
        for chunk in dec.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(chunk.text, end="")

The native extension is loaded on first construction, never at import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

from . import cost_cache
from .sampling import SamplingParams

__all__ = ["DFlashDecoder", "GenerationResult", "GenerationStats", "StreamChunk", "TokenLogprob"]

Prompt = Union[str, Sequence[int]]


@dataclass(frozen=True)
class GenerationStats:
    """Statistics of one generation.

    Attributes:
        n_prompt: Prompt tokens.
        n_cached: Prompt tokens reused from the prompt cache, not prefilled (llama-server's
            ``timings.cache_n``, OpenAI's ``usage.prompt_tokens_details.cached_tokens``).
        n_cache_restored: Of those, tokens restored from the RAM prompt cache (0 when the reused
            prefix was the one live in the contexts).
        k_hist: ``[k]`` = cycles that verified ``k`` drafts (``k_hist[0]``: plain target decodes).
        n_drafter_skipped: Cycles in which the adaptive policy did not run the drafter.
        predicted_tokens_per_second / measured_tokens_per_second: Over the adaptive cycles, the
            cost model's expected rate of the chosen k (expected tokens / predicted time) and the
            rate measured (committed tokens / wall time of those cycles); 0 without adaptation.
        n_generated: Generated tokens (including a final EOG token).
        n_cycles: Target verification passes after the prefill (one per draft/verify cycle).
        n_drafted: Draft tokens sent to verification (after ``n_draft_max`` / ``p_min`` / budget
            truncation; the drafter always computes the full trained block).
        n_accepted: Draft tokens accepted.
        acceptance_length: Mean tokens committed per verification pass, bonus included (tau
            of the DFlash papers); 1.0 means no draft was ever accepted; 0 if no cycle ran.
        per_position_acceptance: ``[i]`` = P(draft i accepted | drafts 0..i-1 accepted and draft
            i was verified) over this generation (NaN where never reached).
        pos_reached / pos_accepted: The counts behind ``per_position_acceptance``.
        t_prefill_s / t_target_s / t_draft_s / t_inject_s / t_sample_s / t_total_s: Seconds in
            the prefill, target verify passes, drafter block passes, drafter feature injection,
            host-side acceptance/sampling, and the whole generation.
        tokens_per_second: ``n_generated / t_total_s`` (prefill included).
        decode_tokens_per_second: ``(n_generated - 1) / (t_total_s - t_prefill_s)`` (the first
            token comes from the prefill).
        stop_reason: ``"length"``, ``"eog"``, ``"stop"`` or ``"context"``.
        rollback: How rejected drafts left the target's memory: ``"kv"`` (a plain KV cache),
            ``"native"`` (recurrent-state snapshots, llama.cpp's ``n_rs_seq``) or
            ``"checkpoint"`` (a copy of the recurrent state before each verify pass, restored on
            a rejection, and the accepted tokens decoded again); see native/target_memory.h.
        n_rollbacks: Cycles whose rejected drafts were dropped from the target's memory.
        n_redecoded: Tokens decoded again after a checkpoint restore.
        t_rollback_s: Seconds in state copies, restores, re-decodes and tail removals.
        n_checkpoints: Prompt checkpoints the target holds after this generation (targets with a
            recurrent state or a sliding window: what a later prompt can reuse).
        n_ctx_shifts: Context shifts (``context_shift``) during this generation.
        sources: Per draft source (``"draft-dflash"``, ``"ngram-simple"``, ``"ngram-mod"``):
            ``{"cycles": cycles its drafts were verified in, "drafted": drafts verified,
            "accepted": drafts accepted}``. A cycle whose context drafts the DFlash block
            continued counts for both sources, each with its own rows.
        n_continued: Cycles whose context drafts the DFlash block continued (the context drafts
            in place of the block's first mask tokens, the lattice walk after them).
    """

    n_prompt: int
    n_generated: int
    n_cycles: int
    n_drafted: int
    n_accepted: int
    acceptance_length: float
    per_position_acceptance: list
    pos_reached: list
    pos_accepted: list
    t_prefill_s: float
    t_target_s: float
    t_draft_s: float
    t_inject_s: float
    t_sample_s: float
    t_total_s: float
    tokens_per_second: float
    decode_tokens_per_second: float
    stop_reason: str
    n_cached: int = 0
    n_cache_restored: int = 0
    k_hist: list = dataclasses.field(default_factory=list)
    n_drafter_skipped: int = 0
    predicted_tokens_per_second: float = 0.0
    measured_tokens_per_second: float = 0.0
    rollback: str = "kv"
    n_rollbacks: int = 0
    n_redecoded: int = 0
    t_rollback_s: float = 0.0
    n_checkpoints: int = 0
    sources: dict = dataclasses.field(default_factory=dict)
    n_ctx_shifts: int = 0
    n_continued: int = 0

    @classmethod
    def _from_native(cls, d: Mapping[str, Any]) -> "GenerationStats":
        cyc = int(d["n_cycles"])
        reached, accepted = list(d["pos_reached"]), list(d["pos_accepted"])
        total = d["t_total_ms"] / 1000.0
        pre = d["t_prefill_ms"] / 1000.0
        n = int(d["n_generated"])
        return cls(
            n_prompt=int(d["n_prompt"]),
            n_cached=int(d["n_cached"]),
            n_cache_restored=int(d["n_cache_restored"]),
            k_hist=list(d["k_hist"]),
            n_drafter_skipped=int(d["n_drafter_skipped"]),
            predicted_tokens_per_second=(1000.0 * d["predicted_tokens"] / d["predicted_ms"]) if d["predicted_ms"] else 0.0,
            measured_tokens_per_second=(1000.0 * (d["n_committed_cycles"]) / d["measured_ms"]) if d["measured_ms"] else 0.0,
            n_generated=n,
            n_cycles=cyc,
            n_drafted=int(d["n_drafted"]),
            n_accepted=int(d["n_accepted"]),
            acceptance_length=(d["n_committed_cycles"] / cyc) if cyc else 0.0,
            per_position_acceptance=[(a / r) if r else float("nan") for a, r in zip(accepted, reached)],
            pos_reached=reached,
            pos_accepted=accepted,
            t_prefill_s=pre,
            t_target_s=d["t_target_ms"] / 1000.0,
            t_draft_s=d["t_draft_ms"] / 1000.0,
            t_inject_s=d["t_inject_ms"] / 1000.0,
            t_sample_s=d["t_sample_ms"] / 1000.0,
            t_total_s=total,
            tokens_per_second=(n / total) if total > 0 else 0.0,
            decode_tokens_per_second=((n - 1) / (total - pre)) if n > 1 and total > pre else 0.0,
            stop_reason=str(d["stop_reason"]),
            rollback=str(d["rollback"]) or "kv",
            n_rollbacks=int(d["n_rollbacks"]),
            n_redecoded=int(d["n_redecoded"]),
            t_rollback_s=d["t_rollback_ms"] / 1000.0,
            n_checkpoints=int(d["n_checkpoints"]),
            n_ctx_shifts=int(d["n_ctx_shifts"]),
            n_continued=int(d["n_continued"]),
            sources={str(k): {kk: int(vv) for kk, vv in v.items()} for k, v in d["sources"].items()},
        )


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token under the target's distribution after logit bias,
    penalties and grammar (before top-k / top-p / min-p and temperature), and the most likely
    alternatives at that position (``SamplingParams.n_probs`` of them). The same numbers with or
    without a drafter: they come from the verify row that committed the token, conditioned on the
    text before it.

    Attributes:
        token: The token id.
        logprob: Its natural-log probability.
        top: ``[(token id, logprob), ...]``, most likely first (ties: lower id first).
    """

    token: int
    logprob: float
    top: list

    @classmethod
    def _from_native(cls, token: int, lp: tuple) -> "TokenLogprob":
        return cls(token=int(token), logprob=float(lp[0]), top=[(int(t), float(v)) for t, v in lp[1]])


@dataclass(frozen=True)
class GenerationResult:
    """Output of :meth:`DFlashDecoder.generate`.

    Attributes:
        text: Detokenized output (special tokens not rendered; cut before a stop string).
        tokens: Generated token ids (an EOG token that ended the output is included).
        from_draft: Per token, True when it was an accepted draft, False when the target sampled
            it (the prefill's token and each cycle's bonus).
        stats: :class:`GenerationStats`.
        logprobs: Per token a :class:`TokenLogprob` when ``n_probs > 0``, else None.
    """

    text: str
    tokens: list
    from_draft: list
    stats: GenerationStats
    logprobs: Optional[list] = None

    @property
    def finish_reason(self) -> str:
        """``"length"``, ``"eog"``, ``"stop"`` or ``"context"``."""
        return self.stats.stop_reason


@dataclass(frozen=True)
class StreamChunk:
    """Tokens committed by one cycle (the first chunk: the prefill's token).

    Attributes:
        text: New text since the previous chunk (UTF-8 safe; may be empty mid-character).
        tokens: Token ids committed in this cycle.
        from_draft: Per token, whether it was an accepted draft.
        done: True on the last chunk; ``stats`` is then set.
        stats: :class:`GenerationStats` on the last chunk, else None.
        logprobs: Per token a :class:`TokenLogprob` when ``n_probs > 0``, else None.
    """

    text: str
    tokens: list
    from_draft: list
    done: bool
    stats: Optional[GenerationStats] = None
    logprobs: Optional[list] = None


def _cut_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class DFlashDecoder:
    """A target GGUF plus an optional DFlash/DFlash 2 drafter GGUF, decoded by the native driver.

    Args:
        target: Path of the target model GGUF (any architecture libllama 0c1e570 loads; the
            drafter's features come from layer inputs on the 19 architectures that record them,
            else from a ``cb_eval`` capture of ``l_out-{id}``).
        drafter: Path of a ``dflash`` GGUF produced for this target, or None for the target
            alone (same code path, no drafts).
        n_ctx: Target context size in tokens (prompt + generation must fit).
        n_ctx_draft: Drafter context size (default: ``n_ctx``).
        n_threads / n_threads_draft: CPU threads (default: all cores / same as target).
        n_gpu_layers / n_gpu_layers_draft: Layers offloaded (llama.cpp semantics, -1 = all;
            effective only when llama-cpp-python was built with CUDA/Metal/...).
        n_batch: Target prefill chunk.
        flash_attn: None = llama.cpp auto, True/False to force.
        repack: CPU weight repacking (llama.cpp ``--repack``, the default; False is
            ``--no-repack``: weights stay in the GGUF's layout). Repacked K-quant weights take
            other kernels for a one-token decode than for a batched pass; see "Exactness at
            T = 0" in the README.
        kv_f32_draft: F32 drafter K/V cache instead of F16 (bit-level parity work).
        capture: ``"auto"`` | ``"layer_inp"`` | ``"cb_eval"`` feature capture path.
        cost_model: The adaptive draft length's cost model: ``"auto"`` measures it on the first
            adaptive generation (a few target passes of 1..block rows and drafter passes after a
            short synthetic prompt, about a second on a 2-core CPU) and keeps it in
            ``<cache>/cost-models.json`` keyed by the two files, threads, GPU layers, flash
            attention and repacking, so later runs start calibrated; a mapping
            ``{"verify_ms": [ms of a target pass over 1, 2, ... rows], "draft_ms": ms of a
            drafter pass}`` sets it and keeps it fixed; None leaves adaptation off. A measured
            model updates online as cycles run; with ``"auto"``, :meth:`close` saves it with the
            policy's acceptance calibration and gate, which the next decoder restores.
        cache_ram_mib: Budget of the RAM prompt cache in MiB (llama-server's ``--cache-ram``; 0
            turns it off): prefixes (target KV + drafter state) saved before the live prompt
            cache is overwritten, restored when a later prompt shares more with one of them, so
            that a short side request does not evict a long conversation. Least recently used
            entries go first.
        swa_full: llama.cpp's ``--swa-full``: a sliding-window target (gemma3, gpt-oss, ...)
            keeps every cell of its windowed layers. Off (the default, as in llama-server) it
            keeps the window plus one batch, and a prompt that reuses a prefix whose window has
            been overwritten restarts from a prompt checkpoint (native/target_memory.h).
        context_draft_max: The most context drafts (``spec_type`` ngram-simple / ngram-mod) a
            cycle verifies (64: llama.cpp's ngram-mod n_max). A target with a recurrent state
            that rolls back natively keeps one snapshot of it per draft (memory), so there at
            most 16 context drafts are verified a cycle. 0 turns context drafts off.
        spec_type: The draft sources of this decoder's generations when a call gives none
            (:meth:`generate`'s ``spec_type``; None: all three with a drafter, none without).
        verbose: Print llama.cpp's own log (model loading, contexts) to stderr; otherwise only
            its errors. The setting is process-wide (``llama_log_set``).

    Raises:
        FileNotFoundError: a path does not exist.
        IncompatibleDrafterError: vocab / hidden size / target layer ids / DFlash 2 width
            mismatch, checked before the drafter context exists.
        UnsupportedError: recurrent/hybrid target with a drafter, or ``capture="layer_inp"`` on
            an architecture whose graph does not record layer inputs.
        ModelLoadError: libllama could not load a model or create a context.

    Resources are freed by :meth:`close` (idempotent), by ``with``, or at garbage collection.
    One decoder runs one generation at a time (calls are serialized by a lock).
    """

    def __init__(
        self,
        target: Union[str, os.PathLike],
        drafter: Union[str, os.PathLike, None] = None,
        *,
        n_ctx: int = 4096,
        n_ctx_draft: Optional[int] = None,
        n_threads: Optional[int] = None,
        n_threads_draft: Optional[int] = None,
        n_gpu_layers: int = 0,
        n_gpu_layers_draft: Optional[int] = None,
        n_batch: int = 512,
        flash_attn: Optional[bool] = None,
        kv_f32_draft: bool = False,
        repack: bool = True,
        capture: str = "auto",
        cache_ram_mib: int = 1024,
        swa_full: bool = False,
        context_draft_max: int = 64,
        spec_type: Union[str, Sequence[str], None] = None,
        cost_model: Union[str, Mapping[str, Any], None] = "auto",
        verbose: bool = False,
    ) -> None:
        self._engine = None
        self._lock = threading.Lock()
        for p in (target, drafter):
            if p is not None and not Path(p).is_file():
                raise FileNotFoundError(f"no such GGUF file: {p}")
        if capture not in ("auto", "layer_inp", "cb_eval"):
            raise ValueError("capture must be 'auto', 'layer_inp' or 'cb_eval'")
        from .._native_loader import native

        n = native()
        # llama.cpp's loader logs go to stderr only when asked (errors always do).
        n.set_log_level(1 if verbose else 4)
        o = n.EngineOptions()
        o.target_path = str(target)
        o.drafter_path = "" if drafter is None else str(drafter)
        o.n_ctx = int(n_ctx)
        o.n_ctx_draft = int(n_ctx_draft or 0)
        o.n_threads = int(n_threads or 0)
        o.n_threads_draft = int(n_threads_draft or 0)
        o.n_gpu_layers = int(n_gpu_layers)
        o.n_gpu_layers_draft = int(n_gpu_layers if n_gpu_layers_draft is None else n_gpu_layers_draft)
        o.n_batch = int(n_batch)
        o.flash_attn = -1 if flash_attn is None else int(bool(flash_attn))
        o.kv_f32_draft = bool(kv_f32_draft)
        o.repack = bool(repack)
        o.capture = capture
        if int(cache_ram_mib) < 0:
            raise ValueError("cache_ram_mib must be >= 0 (0 disables the RAM prompt cache)")
        o.cache_ram_mib = int(cache_ram_mib)
        o.swa_full = bool(swa_full)
        if int(context_draft_max) < 0:
            raise ValueError("context_draft_max must be >= 0 (0: no context drafts)")
        o.context_draft_max = int(context_draft_max)
        from .params import parse_spec_types

        parse_spec_types(spec_type)  # ValueError now for an unknown name
        self._spec_type = spec_type
        self.target_path = str(target)
        self.drafter_path = None if drafter is None else str(drafter)
        if not (cost_model in ("auto", None) or isinstance(cost_model, Mapping)):
            raise ValueError("cost_model must be 'auto', None or {'verify_ms': [...], 'draft_ms': float}")
        self._cost_key = json.dumps([cost_cache.file_id(target), cost_cache.file_id(drafter), o.n_threads,
                                     o.n_threads_draft, o.n_gpu_layers, o.n_gpu_layers_draft, o.flash_attn, o.repack,
                                     n.PINNED_LLAMA_CPP_COMMIT])
        self._engine = n.Engine(o)
        self._cost_mode = cost_model
        if isinstance(cost_model, Mapping):
            self._set_costs(cost_model)

    @classmethod
    def from_llama(cls, llama: Any, drafter: Union[str, os.PathLike, None] = None, **kwargs: Any) -> "DFlashDecoder":
        """Build a decoder for the target of an existing ``llama_cpp.Llama``.

        The target GGUF is loaded again from ``llama.model_path`` (memory-mapped, so the weights
        are shared by the page cache on CPU) with the Llama's ``n_ctx``, ``n_threads`` and
        ``n_gpu_layers`` unless given in ``kwargs``: libllama fixes a context's capture callback
        at creation, so the driver needs a target context of its own.
        """
        kwargs.setdefault("n_ctx", llama.n_ctx())
        kwargs.setdefault("n_threads", getattr(llama, "n_threads", None))
        mp = getattr(llama, "model_params", None)
        if mp is not None:
            kwargs.setdefault("n_gpu_layers", int(mp.n_gpu_layers))
        return cls(llama.model_path, drafter, **kwargs)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Free contexts, then models. Safe to call more than once. With ``cost_model="auto"``
        the cost model as updated online and what the adaptive policy learnt (the acceptance
        calibration, the gate) go to ``<cache>/cost-models.json`` first, so that the next decoder
        of the same files and settings starts where this one stopped."""
        eng, self._engine = getattr(self, "_engine", None), None
        if eng is not None:
            try:
                self._save_learnt(eng)
            finally:
                eng.close()

    def _save_learnt(self, eng: Any) -> None:
        if getattr(self, "_cost_mode", None) != "auto" or not eng.has_drafter:
            return
        c = eng.cost_model()
        if not cost_cache.is_whole(c.verify_ms, eng.block_size):
            return  # only what cycles observed (never measured or loaded)
        try:
            cost_cache.save(self._cost_key, {"verify_ms": list(c.verify_ms), "draft_ms": c.draft_ms,
                                              "policy": dict(eng.policy_state())})
        except OSError:
            pass  # a read-only cache costs the next run a measurement, nothing else

    def __enter__(self) -> "DFlashDecoder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    @property
    def engine(self):
        """The native ``Engine`` (private API; raises ClosedError when closed)."""
        if self._engine is None:
            from ..errors import ClosedError

            raise ClosedError("the decoder is closed", 6, 0)
        return self._engine

    # ------------------------------------------------------------------ introspection

    @property
    def has_drafter(self) -> bool:
        return self.engine.has_drafter

    @property
    def block_size(self) -> int:
        """Trained block size of the drafter (rows per draft pass incl. the anchor); 0 without."""
        return self.engine.block_size

    @property
    def drafter_version(self) -> int:
        """2 for a DFlash 2 drafter (candidate selector), 1 for DFlash 1, 0 without drafter."""
        e = self.engine
        return 0 if not e.has_drafter else (2 if e.selector_top_k > 0 else 1)

    @property
    def capture_path(self) -> str:
        """``"layer_inp"`` or ``"cb_eval"`` (``""`` without drafter)."""
        return self.engine.capture_path

    @property
    def rollback_mode(self) -> str:
        """How rejected drafts leave the target's memory: ``"kv"``, ``"native"`` (recurrent-state
        snapshots) or ``"checkpoint"`` (state copy, restore, re-decode); see
        :attr:`GenerationStats.rollback`."""
        return self.engine.rollback_mode

    @property
    def n_vocab(self) -> int:
        return self.engine.n_vocab

    @property
    def cost_model(self) -> Optional[dict]:
        """``{"verify_ms": [...], "draft_ms": float, "rollback_ms": float}`` now in use (None
        before it is measured or set): ms of a target pass over 1, 2, ... rows, of a drafter pass,
        and of rolling a recurrent target back by checkpoint per drafting cycle (0 elsewhere)."""
        c = self.engine.cost_model()
        return cost_cache.as_dict(c) if c.valid else None

    def measure_cost_model(self, reps: int = 3, save: bool = True) -> dict:
        """Measure the cost model now (clears the prompt cache) and, with ``save``, keep it in
        ``<cache>/cost-models.json`` for later decoders of the same files and settings."""
        with self._lock:
            c = self.engine.measure_costs(int(reps))
        d = cost_cache.as_dict(c)
        if save:
            cost_cache.save(self._cost_key, d)
        return d

    def _set_costs(self, d: Mapping[str, Any], fixed: bool = True) -> None:
        from .._native_loader import native

        c = native().CostModel()
        c.fixed = bool(fixed)
        c.verify_ms = [float(x) for x in d["verify_ms"]]
        c.draft_ms = float(d.get("draft_ms", 0.0))
        c.rollback_ms = float(d.get("rollback_ms", 0.0))
        if not c.valid or any(x <= 0 for x in c.verify_ms):
            raise ValueError("cost_model verify_ms must be positive milliseconds for 1, 2, ... rows")
        self.engine.set_cost_model(c)

    def _ensure_costs(self) -> None:
        rows = self.engine.cost_rows()  # a DFlash block, the longest context draft that n_ctx allows
        if self._cost_mode != "auto" or cost_cache.is_whole(self.engine.cost_model().verify_ms, rows):
            return  # set, or whole (fixed-k cycles alone observe some row counts only)
        saved = cost_cache.load().get(self._cost_key)
        if not isinstance(saved, Mapping) or not cost_cache.is_whole(saved.get("verify_ms"), rows):
            self.measure_cost_model()  # none saved, or a damaged / partial entry
            return
        self._set_costs(saved, fixed=False)
        pol = saved.get("policy")
        if isinstance(pol, Mapping):
            try:
                self.engine.set_policy_state([float(x) for x in pol["reached"]], [float(x) for x in pol["accepted"]],
                                             float(pol["gate_rate"]), int(pol["gate_interval"]))
            except (KeyError, TypeError, ValueError):
                pass  # an older or damaged entry: the policy starts from its prior

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list:
        """Token ids of ``text`` with the target's tokenizer (BOS per the GGUF when add_special)."""
        return list(self.engine.tokenize(text, add_special, parse_special))

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        """Text of ``tokens`` (special tokens rendered only when ``special``)."""
        return bytes(self.engine.detokenize(list(tokens), special)).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
        documents: Optional[Sequence[Mapping[str, Any]]] = None,
        chat_template: Optional[str] = None,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        jinja: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render chat ``messages`` with the target GGUF's own Jinja chat template, exactly as
        ``transformers``' ``apply_chat_template(..., tokenize=False)`` renders it
        (:class:`dflash2_gguf.chat.templates.ChatRenderer`; ChatML for a GGUF without a template).

        Args:
            messages: OpenAI-shaped messages: system / user / assistant / tool roles, content as
                a string or a list of text parts, assistant ``tool_calls`` (arguments as a JSON
                string or a dict), ``tool_call_id``.
            add_generation_prompt: End with the assistant turn's opening.
            tools: OpenAI tool specs, given to the template as ``tools``.
            documents: RAG documents for templates that take them.
            chat_template: A template text instead of the GGUF's (``--chat-template``).
            chat_template_kwargs / **template_kwargs: Extra template variables (e.g.
                ``enable_thinking=False``).
            jinja: False renders with libllama's built-in template guess instead
                (``llama_chat_apply_template``, llama-server's ``--no-jinja``).

        Returns:
            The prompt text (BOS included when the template writes it; :meth:`generate` with
            ``messages`` drops it before tokenizing when the tokenizer adds BOS itself).

        Raises:
            dflash2_gguf.chat.templates.ChatTemplateError (a ValueError): malformed messages, or the
                template refused or failed to render them (the message names the template).
        """
        from ..chat.templates import render_builtin, renderer_for

        kw = {**(chat_template_kwargs or {}), **template_kwargs}
        if not jinja:
            return render_builtin(chat_template or self.engine.chat_info()["chat_template"], messages,
                                  add_generation_prompt=add_generation_prompt)
        return renderer_for(self, chat_template).render(messages, tools=tools, documents=documents,
                                                        add_generation_prompt=add_generation_prompt, **kw)

    def _spec_bits(self, spec_type: Union[str, Sequence[str], None]) -> int:
        """``spec_type`` as the native SpecType bits (ValueError: an unknown name, or
        draft-dflash without a drafter)."""
        from .._native_loader import native
        from .params import effective_spec_types

        n = native()
        names = effective_spec_types(spec_type, self.has_drafter)
        if "draft-dflash" in names and not self.has_drafter:
            raise ValueError("spec_type draft-dflash needs a drafter GGUF (this decoder has none)")
        bits = {"draft-dflash": n.SPEC_DFLASH, "ngram-simple": n.SPEC_NGRAM_SIMPLE, "ngram-mod": n.SPEC_NGRAM_MOD}
        out = 0
        for name in names:
            out |= bits[name]
        return out

    def _prompt_ids(self, prompt: Optional[Prompt], messages: Optional[Sequence[Mapping[str, Any]]]) -> list:
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt (str or token ids) and messages")
        if messages is not None:
            # the chat as llama-server feeds it: rendered, a template-written BOS dropped when the
            # tokenizer adds one, special tokens parsed (dflash2_gguf.chat.templates.chat_prompt_ids)
            from ..chat.templates import chat_prompt_ids

            return chat_prompt_ids(self, messages)
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=False)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    # ------------------------------------------------------------------ generation

    def _params(self, max_tokens: int, sampling: Optional[SamplingParams], stop, n_draft_max, p_min,
                use_drafter, ignore_eos, cache_prompt, overrides: Mapping[str, Any], test_fault: int):
        sp = sampling if sampling is not None else SamplingParams()
        if overrides:
            bad = set(overrides) - {f.name for f in dataclasses.fields(SamplingParams)}
            if bad:
                raise TypeError(f"unknown sampling argument(s): {', '.join(sorted(bad))}")
            sp = dataclasses.replace(sp, **overrides)
        if int(max_tokens) < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (0.0 <= p_min <= 1.0):
            raise ValueError("p_min must be in [0, 1]")
        from .._native_loader import native

        n = native()
        g = n.GenParams()
        g.sampling = sp.to_native(n.SamplingOptions)
        g.n_predict = int(max_tokens)
        g.n_draft_max = -1 if n_draft_max is None else int(n_draft_max)
        g.p_min = float(p_min)
        g.use_drafter = bool(use_drafter)
        g.ignore_eog = bool(ignore_eos)
        g.cache_prompt = bool(cache_prompt)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        g.stop = stops
        g.test_fault = int(test_fault)
        return g, stops, sp.n_probs > 0

    def generate(
        self,
        prompt: Optional[Prompt] = None,
        *,
        messages: Optional[Sequence[Mapping[str, str]]] = None,
        max_tokens: int = 128,
        sampling: Optional[SamplingParams] = None,
        stop: Union[str, Sequence[str], None] = None,
        n_draft_max: Optional[int] = None,
        p_min: float = 0.0,
        use_drafter: bool = True,
        ignore_eos: bool = False,
        cache_prompt: bool = True,
        adaptive: bool = True,
        n_draft_min: int = 0,
        spec_type: Union[str, Sequence[str], None] = None,
        spec_accept: str = "rejection",
        context_shift: bool = False,
        n_keep: int = 0,
        n_discard: int = 0,
        spec_ngram_simple_size_n: Optional[int] = None,
        spec_ngram_simple_size_m: Optional[int] = None,
        spec_ngram_mod_n_match: Optional[int] = None,
        spec_ngram_mod_n_max: Optional[int] = None,
        spec_ngram_mod_n_min: Optional[int] = None,
        stream: bool = False,
        _test_fault: int = 0,
        **sampling_overrides: Any,
    ) -> Union[GenerationResult, Iterator[StreamChunk]]:
        """Generate from a prompt string, token ids, or chat messages.

        Args:
            prompt: Text (tokenized with BOS per the GGUF) or a sequence of token ids.
            messages: Chat messages rendered with the GGUF's chat template (instead of prompt).
            max_tokens: Maximum generated tokens (>= 1).
            sampling: :class:`SamplingParams`; default: llama-cpp-python's defaults
                (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, random seed).
            stop: Stop string(s): generation ends at the token completing one; the text is cut
                before it.
            n_draft_max: Drafts verified per cycle (the drafter always computes its full trained
                block; this only truncates afterwards). Default: block size - 1.
            p_min: Stop drafting at the first row whose most likely candidate has probability
                < p_min (v2: softmax of the selector scores at temperature 1; v1: softmax of the
                draft logits), judged before that row's draft is drawn so that T > 0 stays
                lossless (for greedy drafting: the draft's own probability, llama.cpp's meaning).
            use_drafter: False runs the target alone through the same loop.
            ignore_eos: Do not stop on end-of-generation tokens.
            cache_prompt: Reuse the longest common token prefix with what the decoder holds (the
                last generation's prompt and output, or a prefix saved in the RAM prompt cache):
                only the rest of the prompt is prefilled (``stats.n_cached`` tells how many were
                reused). False prefills the whole prompt (llama-server's ``cache_prompt``).
            adaptive: Choose the number of drafts every cycle (at most ``n_draft_max``) from the
                cost model and the drafter's confidence, calibrated online; skip the drafter
                pass while drafting does not pay, probing again from time to time
                (``native/draft_policy.h``). The output is the same (T = 0) or identically
                distributed (T > 0) either way; the choice depends on measured timings, so at
                T > 0 a seed reproduces the distribution, not the exact text. False: always
                ``n_draft_max`` drafts (llama.cpp's fixed ``--spec-draft-n-max``).
            n_draft_min: With ``adaptive``, when the drafter runs, verify at least this many drafts
                (llama.cpp's ``--spec-draft-n-min`` / llama-server's ``speculative.n_min``): a floor
                under the adaptive choice, decided before the drafts are drawn (lossless).
            spec_type: Which draft sources may draft (llama.cpp's ``--spec-type`` names, a
                comma-separated string or a list): ``draft-dflash`` (the drafter GGUF),
                ``ngram-simple`` (prompt lookup: the tokens that followed the most recent earlier
                occurrence of the longest suffix of prompt + output), ``ngram-mod`` (an n-gram
                pool filled from every request of this decoder), ``none``. Each cycle the source
                whose drafts promise the most tokens per second wins (with ``adaptive``; without,
                a context match wins, as in llama.cpp); context drafts are point masses, so the
                output stays exact. Default: all three with a drafter, none without
                (``native/context_drafter.h``).
            spec_accept: How drafts are accepted at T > 0. ``"rejection"``: rejection sampling
                with each draft's probability q (Leviathan et al. 2023): the target's
                distribution, and the most drafts accepted; a seed gives a text of that
                distribution, not the target alone's. ``"target-sample"``: llama-server's rule
                (common/sampling.cpp ``common_sampler_sample_and_accept_n``): each verify row draws
                the target's own token, one draw per committed token as without a drafter, and a
                draft is kept when it equals that draw: for a seed, the target-alone text token
                for token, at the cost of fewer accepted drafts. Greedy (T = 0) is the same
                either way.
            context_shift: When prompt + output fill ``n_ctx``, drop ``n_discard`` tokens (0: half
                of those after ``n_keep``) after the first ``n_keep`` (-1: the whole prompt; a BOS
                is kept on top) from the target's and the drafter's caches and go on, as
                llama-server's ``--context-shift`` does. Without it the generation ends with
                stop reason ``"context"``. Targets with a recurrent state cannot shift
                (UnsupportedError).
            spec_ngram_simple_size_n / spec_ngram_simple_size_m: ngram-simple's shortest suffix
                looked up and most drafts (llama.cpp's ``--spec-ngram-simple-size-n/-m``).
            spec_ngram_mod_n_match / spec_ngram_mod_n_max / spec_ngram_mod_n_min: ngram-mod's
                n-gram length, most drafts, and fewest chained drafts it offers. None: the
                defaults of the parameter table (llama.cpp's, native ``NgramParams``).
            stream: Return an iterator of :class:`StreamChunk` instead of a result.
            _test_fault: TEST HOOK of the lossless tests' negative controls
                (``native/acceptance.h`` ``TestFault``); never set it otherwise.
            **sampling_overrides: Any :class:`SamplingParams` field (``temperature``,
                ``presence_penalty``, ``grammar``, ``n_probs``, ...), applied on top of ``sampling``.

        Returns:
            :class:`GenerationResult`, or an iterator of :class:`StreamChunk` when ``stream``.

        Raises:
            ValueError: bad arguments; ContextFullError: the prompt does not fit ``n_ctx``;
            DecodeError: libllama failed (``rc`` carried); ClosedError: decoder closed.
        """
        ids = self._prompt_ids(prompt, messages)
        g, stops, want_lp = self._params(max_tokens, sampling, stop, n_draft_max, p_min, use_drafter, ignore_eos,
                                         cache_prompt, sampling_overrides, _test_fault)
        g.adaptive = bool(adaptive)
        if int(n_draft_min) < 0:
            raise ValueError("n_draft_min must be >= 0")
        g.n_draft_min = int(n_draft_min)
        g.spec_types = self._spec_bits(self._spec_type if spec_type is None else spec_type)
        if spec_accept not in ("rejection", "target-sample"):
            raise ValueError(f"spec_accept must be 'rejection' or 'target-sample', not {spec_accept!r}")
        g.accept_mode = 0 if spec_accept == "rejection" else 1
        g.context_shift, g.n_keep, g.n_discard = bool(context_shift), int(n_keep), int(n_discard)
        ng = g.ngram  # native NgramParams defaults; a given value replaces its field
        for field, v in (("simple_size_n", spec_ngram_simple_size_n), ("simple_size_m", spec_ngram_simple_size_m),
                         ("mod_n_match", spec_ngram_mod_n_match), ("mod_n_max", spec_ngram_mod_n_max),
                         ("mod_n_min", spec_ngram_mod_n_min)):
            if v is not None:
                setattr(ng, field, int(v))
        g.ngram = ng
        if adaptive and use_drafter and g.spec_types:
            self._ensure_costs()
        if stream:
            return self._stream(ids, g, stops)
        eng = self.engine
        logprobs: Optional[list] = [] if want_lp else None

        def on_chunk(chunk: tuple) -> bool:
            logprobs.extend(TokenLogprob._from_native(t, lp) for t, lp in zip(chunk[0], chunk[3]))
            return True

        with self._lock:
            out = list(eng.generate(ids, g, on_chunk if want_lp else None))
            from_draft = list(eng.from_draft())
            stats = GenerationStats._from_native(eng.stats())
        text = self.detokenize(out)
        if stops:
            text, _ = _cut_stop(text, stops)
        return GenerationResult(text=text, tokens=out, from_draft=from_draft, stats=stats, logprobs=logprobs)

    def stream(self, prompt: Optional[Prompt] = None, **kwargs: Any) -> Iterator[StreamChunk]:
        """Same as ``generate(..., stream=True)``."""
        return self.generate(prompt, stream=True, **kwargs)

    def _stream(self, ids: list, g, stops: list) -> Iterator[StreamChunk]:
        """The chunks of one generation. Stop strings go through a
        :class:`~dflash2_gguf.chat.stops.StopStringBuffer`: a tail that may still become a stop string is
        held back until it cannot, so the chunks' texts concatenate to exactly the non-streamed text
        (cut before the earliest stop string) and never contain the start of a cut stop string."""
        from .detok import StreamingDetokenizer
        from ..chat.stops import StopStringBuffer

        eng = self.engine
        text = StreamingDetokenizer(lambda t: eng.detokenize(t, False))  # linear in the output
        buf = StopStringBuffer(stops)
        with self._lock:
            toks, fd, done, lps = eng.begin(ids, g)
            while True:
                delta = buf.feed(text.feed(toks, final=done))
                if done:
                    delta += buf.flush()
                stats = GenerationStats._from_native(eng.stats()) if done else None
                lp = [TokenLogprob._from_native(t, x) for t, x in zip(toks, lps)] if lps else None
                yield StreamChunk(text=delta, tokens=list(toks), from_draft=[bool(x) for x in fd], done=done, stats=stats,
                                  logprobs=lp)
                if done:
                    return
                toks, fd, done, lps = eng.step()
