"""Fast training-data generation: batched greedy responses, then features by one prefill.

The one-sequence-at-a-time path (:func:`~dflash2_gguf.train.data.capture_target_features`)
decodes one token per ``llama_decode``; on 2 CPU cores that is ~22 tok/s for SmolLM2-135M Q4_1,
while a prefill runs ~170 tok/s. Here the data stage runs in two phases per shard:

1. **generation** (:class:`BatchedGreedyGenerator`): up to ``n_parallel`` sequences share each
   ``llama_decode`` (one ``seq_id`` each, ``n_seq_max = n_parallel``), with continuous batching:
   a finished sequence (end-of-generation token or ``max_new_tokens``) frees its slot
   (``llama_memory_seq_rm``) and the next prompt is prefilled into it in the same decode call.
   Greedy = argmax of ``llama_get_logits_ith``. Responses are appended to
   ``<out>/responses.jsonl`` as they finish (resumable at the sequence level).
2. **capture**: one teacher-forced prefill per sequence (prompt + response) through
   :class:`~dflash2_gguf.train.capture.LlamaFeatureCapture` (``cb_eval`` on ``l_out-{k}``).

Shards ``shard-NNNNN.safetensors`` (format ``dflash2-gguf-features/1``) each cover
``seqs_per_shard`` consecutive prompts of the given order, so training can start on the first
shards while later ones are produced; a rerun skips finished shards and reuses the responses
already in ``responses.jsonl``.

Numerics: a batched decode runs the Q4_1 matmuls on several rows at once, which may pick other
CPU kernels than a one-row decode (DESIGN.md / tests/test_driver_smollm2.py). Greedy responses
then agree with one-sequence greedy decoding except after near-ties in the logits. The drafter
learns from whatever the target produced (it is still the target's own greedy text under
batched evaluation, which is also how the speculative verifier evaluates blocks).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .capture import _LlamaTarget

__all__ = ["BatchedGreedyGenerator", "prompt_tokens", "generate_capture_shards"]


def prompt_tokens(cap_or_gen, text: str) -> list[int]:
    """Token ids of one user message under the target's chat template (assistant prefix added),
    with a doubled BOS removed (as :func:`~dflash2_gguf.train.capture.iter_captured`)."""
    ptoks = cap_or_gen.tokenize(cap_or_gen.chat_prompt([{"role": "user", "content": text}]))
    bos = cap_or_gen._L.llama_vocab_bos(cap_or_gen.vocab)
    if len(ptoks) > 1 and ptoks[0] == ptoks[1] == bos:
        ptoks = ptoks[1:]
    return ptoks


class BatchedGreedyGenerator(_LlamaTarget):
    """Greedy decoding of many sequences per ``llama_decode`` (llama-cpp-python ctypes API).

    Args:
        model_path: target GGUF.
        n_parallel: sequences decoded together (slots; ``n_seq_max``).
        n_ctx_seq: context per sequence (prompt + response must fit).
        n_batch: most tokens per ``llama_decode`` call (prompt prefills of newly admitted
            sequences share the call with the one-token steps of running ones).
        n_threads: CPU threads (default: all cores).
        kv_unified: one KV buffer shared by all sequences (False: one stream per sequence,
            attention only over the sequence's own cells).
        n_gpu_layers: layers offloaded when llama-cpp-python was built with a GPU backend.
    """

    def __init__(self, model_path: str | Path, *, n_parallel: int = 16, n_ctx_seq: int = 1024,
                 n_batch: int = 2048, n_threads: int | None = None, kv_unified: bool = False,
                 n_gpu_layers: int = 0, verbose: bool = False,
                 target_layer_ids: Sequence[int] | None = None) -> None:
        import llama_cpp as L

        from . import capture as C

        if C._SILENT_LOG is None:
            C._SILENT_LOG = L.llama_log_callback(C._silent)
        if not verbose:
            L.llama_log_set(C._SILENT_LOG, ctypes.c_void_p(0))
        self._L = L
        L.llama_backend_init()
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_parallel = int(n_parallel)
        self.n_ctx_seq = int(n_ctx_seq)
        self.n_batch = max(int(n_batch), self.n_parallel)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = self.n_parallel * self.n_ctx_seq
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(512, self.n_batch)
        cparams.n_seq_max = self.n_parallel
        cparams.kv_unified = bool(kv_unified)
        threads = n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.n_layer = L.llama_model_n_layer(self.model)
        self.n_embd = L.llama_model_n_embd(self.model)
        self.layer_ids = [int(k) for k in target_layer_ids] if target_layer_ids else []
        if self.layer_ids:
            if not kv_unified:
                # one stream per sequence makes llama.cpp regroup the batch by sequence
                # (split_equal); the callback's rows must come in batch order (split_simple)
                raise ValueError("inline capture needs kv_unified=True")
            bad = [k for k in self.layer_ids if not 0 <= k < self.n_layer]
            if bad:
                raise ValueError(f"target has {self.n_layer} layers; bad layer ids {bad}")
            self._g = C._ggml_base()
            self._want = {f"l_out-{k}".encode(): i for i, k in enumerate(self.layer_ids)}
            self._chunks: list[list[np.ndarray]] = [[] for _ in self.layer_ids]
            self._cb = L.ggml_backend_sched_eval_callback(self._callback)  # kept referenced
            cparams.cb_eval = self._cb
            cparams.cb_eval_user_data = None
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._mem = L.llama_get_memory(self.ctx)
        # statistics of the last generate() call
        self.stats = {"prompt_tokens": 0, "new_tokens": 0, "seconds": 0.0, "decode_calls": 0}

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 keys: Sequence | None = None) -> Iterator[tuple]:
        """Greedy responses, yielded in order of completion as ``(key, response ids)``, or
        ``(key, response ids, features float16 [n_prompt + n_response, n_ids * H])`` when the
        generator was made with ``target_layer_ids`` (inline capture).

        ``keys`` (default: the prompt's index) identify the prompts. A response ends with the
        end-of-generation token when one was produced (included, as in
        :func:`~dflash2_gguf.train.capture.generate_and_capture`), else after
        ``max_new_tokens`` tokens (or when the sequence's context is full). With inline
        capture the last token is fed once more (in a later decode call, no logits) so that
        every row has its features.
        """
        L, b = self._L, self._batch
        capture = bool(self.layer_ids)
        # the last layer's l_out is pruned to the rows that output logits
        all_logits = capture and (self.n_layer - 1) in self.layer_ids
        keys = list(range(len(prompts))) if keys is None else list(keys)
        queue = deque(zip(keys, (list(p) for p in prompts)))
        for k, p in queue:
            if not 0 < len(p) < self.n_ctx_seq:
                raise ValueError(f"prompt {k!r} has {len(p)} tokens; the limit is n_ctx_seq-1 = "
                                 f"{self.n_ctx_seq - 1}")
        L.llama_memory_clear(self._mem, True)
        # slot -> {"key", "plen", "gen": generated ids, "feats": list of arrays, "done": bool}
        slots: list[dict | None] = [None] * self.n_parallel
        t0 = time.perf_counter()
        st = {"prompt_tokens": 0, "new_tokens": 0, "seconds": 0.0, "decode_calls": 0}
        self.stats = st
        while queue or any(s is not None for s in slots):
            n = 0
            out_rows: list[tuple[int, int]] = []   # (slot, batch row with logits)
            spans: list[tuple[int, int, int]] = []  # (slot, first row, rows) fed this call

            def add(tok: int, pos: int, seq: int, logits: bool) -> None:
                nonlocal n
                b.token[n] = int(tok)
                b.pos[n] = pos
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = 1 if (logits or all_logits) else 0
                n += 1

            for s, slot in enumerate(slots):  # running (or finishing) sequences: one token each
                if slot is not None:
                    add(slot["gen"][-1], slot["plen"] + len(slot["gen"]) - 1, s, not slot["done"])
                    spans.append((s, n - 1, 1))
                    if not slot["done"]:
                        out_rows.append((s, n - 1))
            for s in range(self.n_parallel):  # admit new prompts while the batch has room
                if slots[s] is None and queue and n + len(queue[0][1]) <= self.n_batch:
                    key, p = queue.popleft()
                    for i, t in enumerate(p):
                        add(t, i, s, i == len(p) - 1)
                    out_rows.append((s, n - 1))
                    spans.append((s, n - len(p), len(p)))
                    slots[s] = {"key": key, "plen": len(p), "gen": [], "feats": [], "done": False}
                    st["prompt_tokens"] += len(p)
            if n == 0:  # pragma: no cover - a prompt longer than n_batch with nothing running
                raise ValueError("a prompt does not fit n_batch")
            b.n_tokens = n
            if capture:
                self._chunks = [[] for _ in self.layer_ids]
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with {rc}")
            st["decode_calls"] += 1
            if capture:
                parts = []
                for k, chunks in zip(self.layer_ids, self._chunks):
                    f = np.concatenate(chunks) if chunks else np.zeros((0, self.n_embd), np.float32)
                    if f.shape != (n, self.n_embd):
                        raise RuntimeError(f"captured l_out-{k} with shape {f.shape}, expected "
                                           f"{(n, self.n_embd)}")
                    parts.append(f)
                feats = np.concatenate(parts, axis=1).astype(np.float16)
                for s, r0, m in spans:
                    slots[s]["feats"].append(feats[r0:r0 + m])
            for s, row in out_rows:
                ptr = L.llama_get_logits_ith(self.ctx, row)
                tok = int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())
                slot = slots[s]
                slot["gen"].append(tok)
                st["new_tokens"] += 1
                if (self.is_eog(tok) or len(slot["gen"]) >= max_new_tokens
                        or slot["plen"] + len(slot["gen"]) >= self.n_ctx_seq):
                    slot["done"] = True
            for s, slot in enumerate(slots):
                if slot is None or not slot["done"]:
                    continue
                if capture and sum(len(f) for f in slot["feats"]) < slot["plen"] + len(slot["gen"]):
                    continue  # its last token is fed in the next call
                L.llama_memory_seq_rm(self._mem, s, -1, -1)
                slots[s] = None
                st["seconds"] = time.perf_counter() - t0
                if capture:
                    yield slot["key"], slot["gen"], np.concatenate(slot["feats"])
                else:
                    yield slot["key"], slot["gen"]
        st["seconds"] = time.perf_counter() - t0



# ------------------------------------------------------------------------------------------
# Shards: generate a chunk, capture it, write it
# ------------------------------------------------------------------------------------------


def _read_responses(path: Path) -> dict[int, dict]:
    done: dict[int, dict] = {}
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: ignore it
                    continue
                done[int(row["i"])] = row
    return done


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _inline_shards(gen, prompts, todo, seqs_per_shard, max_new_tokens, paths, meta, responses, rf,
                   bar, totals, n_parallel) -> None:
    """Inline mode: ONE continuous-batching run over the prompts of every shard to do (no
    half-empty batches at shard ends); shard k is written as soon as all its sequences are in."""
    from .data import write_shard

    need, ptoks, left = [], {}, {}
    for k in todo:
        lo, hi = k * seqs_per_shard, min(len(prompts), (k + 1) * seqs_per_shard)
        left[k] = hi - lo
        for i in range(lo, hi):
            ptoks[i] = prompt_tokens(gen, prompts[i])
            need.append(i)
    done: dict[int, tuple] = {}
    t_last, new_last, all_last = time.perf_counter(), 0, 0
    t_start = t_last
    for i, resp, f in gen.generate([ptoks[i] for i in need], max_new_tokens, keys=need):
        responses[i] = {"i": i, "prompt": ptoks[i], "response": resp}
        rf.write(json.dumps(responses[i]) + "\n")
        rf.flush()
        done[i] = (ptoks[i] + resp, f, len(ptoks[i]))
        new_last += len(resp)
        all_last += len(resp) + len(ptoks[i])
        if bar is not None:
            bar.update(1)
        k = i // seqs_per_shard
        left[k] -= 1
        if left[k] == 0:
            lo, hi = k * seqs_per_shard, min(len(prompts), (k + 1) * seqs_per_shard)
            rows = [done.pop(j) for j in range(lo, hi)]
            write_shard(paths[k], rows, meta)
            now = time.perf_counter()
            dt = now - t_last
            totals["gen_tokens"] += new_last
            totals["gen_all"] += all_last
            totals["gen_s"] = now - t_start
            _log(f"shard {k}: {hi - lo} sequences, {sum(len(r[0]) for r in rows)} tokens -> "
                 f"{paths[k].name}; since the last shard {new_last / dt:.1f} new tok/s, "
                 f"{all_last / dt:.1f} tok/s incl. prompts ({n_parallel} parallel, features inline)")
            _log("totals: {:.1f} new tok/s ({:.1f} incl. prompts) over {} new tokens, {:.0f} s".format(
                totals["gen_tokens"] / totals["gen_s"], totals["gen_all"] / totals["gen_s"],
                totals["gen_tokens"], totals["gen_s"]))
            t_last, new_last, all_last = now, 0, 0


def generate_capture_shards(target_gguf: str | Path, prompts: Sequence[str], out_dir: str | Path,
                            target_layer_ids: Sequence[int], *, max_new_tokens: int = 256,
                            seqs_per_shard: int = 128, n_parallel: int = 16, n_ctx_seq: int = 1024,
                            n_threads: int | None = None, n_gpu_layers: int = 0,
                            mode: str = "inline", progress: bool = True, source: str = "",
                            max_shards: int | None = None, n_batch: int = 2048) -> list[Path]:
    """Shards of target features for ``prompts`` (the order given), ``seqs_per_shard`` prompts per
    shard; resumable (finished shards are kept; in ``prefill`` mode responses already in
    ``responses.jsonl`` are reused).

    ``mode``: ``"inline"`` captures the features in the batched generation decodes themselves
    (one pass over every token: fastest); ``"prefill"`` generates first, then captures with one
    teacher-forced prefill per sequence (prompt + response) in a second context.

    Shard ``k`` holds prompts ``k*seqs_per_shard .. (k+1)*seqs_per_shard - 1``. Existing shards
    must have been made with the same prompt order, ``seqs_per_shard`` and layer ids (the
    layer ids are checked). Logs tokens/s of each phase to stderr. Returns all shard paths.
    ``n_batch``: most tokens per generation decode (see :class:`BatchedGreedyGenerator`).
    """
    from .capture import LlamaFeatureCapture
    from .data import ShardMeta, read_shard_meta, write_shard

    if mode not in ("inline", "prefill"):
        raise ValueError("mode must be 'inline' or 'prefill'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = tuple(int(k) for k in target_layer_ids)
    resp_path = out / "responses.jsonl"
    responses = _read_responses(resp_path)
    prompts = list(prompts)
    n_shards = (len(prompts) + seqs_per_shard - 1) // seqs_per_shard
    if max_shards is not None:
        n_shards = min(n_shards, max_shards)
    paths = [out / f"shard-{k:05d}.safetensors" for k in range(n_shards)]
    for p in paths:
        if p.exists() and read_shard_meta(p).target_layer_ids != ids:
            raise ValueError(f"{p} holds other target layers; cannot resume into {out}")
    todo = [k for k in range(n_shards) if not paths[k].exists()]
    if not todo:
        return paths
    totals = {"gen_tokens": 0, "gen_all": 0, "gen_s": 0.0, "cap_tokens": 0, "cap_s": 0.0}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts[:n_shards * seqs_per_shard]),
                   initial=(n_shards - len(todo)) * seqs_per_shard, desc="data (sequences)",
                   dynamic_ncols=True, file=sys.stderr)
    inline = mode == "inline"
    gen = BatchedGreedyGenerator(target_gguf, n_parallel=n_parallel, n_ctx_seq=n_ctx_seq, n_batch=n_batch,
                                 n_threads=n_threads, n_gpu_layers=n_gpu_layers, kv_unified=inline,
                                 target_layer_ids=ids if inline else None)
    cap = None if inline else LlamaFeatureCapture(target_gguf, ids, n_ctx=n_ctx_seq, n_batch=512,
                                                  n_threads=n_threads, n_gpu_layers=n_gpu_layers)
    try:
        meta = ShardMeta(ids, gen.n_embd, gen.n_vocab, target=Path(target_gguf).name,
                         source=source or f"greedy batched ({n_parallel} parallel) "
                                          f"max_new_tokens={max_new_tokens} capture={mode}")
        with open(resp_path, "a", encoding="utf-8") as rf:
            if inline:
                _inline_shards(gen, prompts, todo, seqs_per_shard, max_new_tokens, paths, meta,
                               responses, rf, bar, totals, n_parallel)
            else:
                for k in todo:
                    lo, hi = k * seqs_per_shard, min(len(prompts), (k + 1) * seqs_per_shard)
                    ptoks = {i: prompt_tokens(gen, prompts[i]) for i in range(lo, hi)}
                    feats: dict[int, np.ndarray] = {}
                    # -- phase 1: batched greedy generation (+ inline features)
                    need = [i for i in range(lo, hi) if inline or i not in responses
                            or responses[i]["prompt"] != ptoks[i]]
                    if need:
                        t = time.perf_counter()
                        ntok = 0
                        for row in gen.generate([ptoks[i] for i in need], max_new_tokens, keys=need):
                            i, resp = row[0], row[1]
                            if inline:
                                feats[i] = row[2]
                                if bar is not None:
                                    bar.update(1)
                            responses[i] = {"i": i, "prompt": ptoks[i], "response": resp}
                            rf.write(json.dumps(responses[i]) + "\n")
                            rf.flush()
                            ntok += len(resp)
                        dt = time.perf_counter() - t
                        nall = ntok + sum(len(ptoks[i]) for i in need)
                        totals["gen_tokens"] += ntok
                        totals["gen_all"] += nall
                        totals["gen_s"] += dt
                        _log(f"shard {k}: generated {len(need)} responses, {ntok} new tokens in {dt:.1f} s "
                             f"= {ntok / dt:.1f} new tok/s, {nall / dt:.1f} tok/s incl. prompts "
                             f"({n_parallel} parallel, {gen.stats['decode_calls']} decode calls"
                             f"{', features inline' if inline else ''})")
                    # -- phase 2: features by one prefill per sequence
                    rows, ntok = [], 0
                    t = time.perf_counter()
                    for i in range(lo, hi):
                        seq = responses[i]["prompt"] + responses[i]["response"]
                        if not inline:
                            cap.reset()
                            feats[i], _ = cap.run(seq)
                            if bar is not None:
                                bar.update(1)
                        rows.append((seq, feats[i], len(responses[i]["prompt"])))
                        ntok += len(seq)
                    if not inline:
                        dt = time.perf_counter() - t
                        totals["cap_tokens"] += ntok
                        totals["cap_s"] += dt
                        _log(f"shard {k}: captured {hi - lo} sequences, {ntok} tokens in {dt:.1f} s = "
                             f"{ntok / dt:.1f} tok/s (prefill)")
                    write_shard(paths[k], rows, meta)
                    _log(f"shard {k}: {hi - lo} sequences, {ntok} tokens -> {paths[k].name}")
                    msg = "totals: generation {:.1f} new tok/s ({:.1f} incl. prompts) over {} new tokens".format(
                        totals["gen_tokens"] / max(totals["gen_s"], 1e-9),
                        totals["gen_all"] / max(totals["gen_s"], 1e-9), totals["gen_tokens"])
                    if not inline:
                        msg += ", capture {:.1f} tok/s over {} tokens".format(
                            totals["cap_tokens"] / max(totals["cap_s"], 1e-9), totals["cap_tokens"])
                    _log(msg)
    finally:
        gen.close()
        if cap is not None:
            cap.close()
    if bar is not None:
        bar.close()
    return paths
