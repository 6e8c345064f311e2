"""Training data: the target's greedy answers and its features, from one native pass.

:class:`BatchedCapture` wraps the extension's ``BatchCapture`` (``native/capture_batch.h``):
up to ``n_parallel`` sequences share each ``llama_decode`` (one ``seq_id`` each), with
continuous batching (a finished sequence frees its slot and the next prompt is prefilled into
it in the next call, beside the others' one-token rows). Greedy = argmax of the target's
logits. The target features of every row, prompt and response, come from those same decode
calls through the engine's ``FeatureCapture`` (``native/capture.h``): llama.cpp's layer-input
recording where the architecture has it (one KV stream per sequence), the ``cb_eval`` callback
otherwise (unified KV, so the callback sees rows in batch order). No per-token Python loop:
one Python call per ``llama_decode``.

Prompts are rendered with the serving chat renderer (:func:`dflash2_gguf.chat.templates.chat_prompt_ids`:
the GGUF's Jinja template, tokenized as llama-server does), so the drafter learns the prompts
that serving produces.

:func:`generate_capture_shards` writes shards ``shard-NNNNN.safetensors`` (format
``dflash2-gguf-features/1``, :mod:`dflash2_gguf.train.data`), each covering ``seqs_per_shard``
consecutive prompts of the given order, and appends every response to ``responses.jsonl`` as
it finishes. ONE continuous-batching run covers every shard still to do (no half-empty batches
at shard ends); a rerun keeps finished shards and makes the others again, from the recorded
answers where ``responses.jsonl`` has them (one teacher-forced prefill each, no generation: a
``responses.jsonl`` kept from another machine rebuilds its shards at prefill speed).

Numerics: a batched decode runs the Q4_1 matmuls and flash attention over several rows at once.
On the CPU, ggml gives a row of a batched pass the same values as a one-row pass while a
sequence stays within 256 KV cells and a decode call has fewer than 64 rows (README, "Exactness
at T = 0"; tests/train/test_train_capture.py); beyond, greedy answers can part from one-sequence
decoding at near-ties. The drafter learns what the target produced under batched evaluation,
which is also how the speculative verifier evaluates a block.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

__all__ = ["BatchedCapture", "CapturedSequence", "generate_capture_shards", "read_responses"]


@dataclass
class CapturedSequence:
    """One finished sequence of :meth:`BatchedCapture.generate`.

    Attributes:
        key: The key the prompt was given with.
        prompt: Prompt token ids.
        response: Greedy token ids; the end-of-generation token is the last one when the target
            produced it, else the answer stopped at ``max_new_tokens`` or a full context.
        features: float16 ``[len(prompt) + len(response), len(target_layer_ids) * n_embd]``: per
            row, the target's hidden states at the HF layer ids (output of decoder layer k),
            concatenated in the order given (the shard format's ``features``).
        stop_reason: ``"eog"``, ``"length"`` or ``"context"``.
    """

    key: object
    prompt: list
    response: list
    features: np.ndarray
    stop_reason: str


class BatchedCapture:
    """Batched greedy generation of the target with feature capture (``native/capture_batch.h``).

    Args:
        target_gguf: Target GGUF.
        target_layer_ids: HF layer ids (``0 .. n_layer - 2``) whose outputs are the features.
        n_parallel: Sequence slots decoded together.
        n_ctx_seq: KV cells per sequence (prompt + response must fit).
        n_batch: Most rows per ``llama_decode`` (one per running sequence plus admitted prompts;
            every prompt must fit). ``n_ubatch``: most rows per compute graph.
        n_threads: CPU threads (None: every core).
        n_gpu_layers: Layers offloaded when llama-cpp-python was built with a GPU backend.
        capture: ``"auto"`` (layer inputs where llama.cpp records them, else ``cb_eval``),
            ``"layer_inp"`` or ``"cb_eval"``.
        verbose: Show llama.cpp's loader log.

    Raises:
        FileNotFoundError: no such GGUF. DFlashError subclasses (:mod:`dflash2_gguf.errors`):
        the target cannot be loaded (ModelLoadError), a layer id is out of range or the
        architecture cannot record layer inputs for ``capture="layer_inp"``. ValueError: bad sizes.
    """

    def __init__(self, target_gguf: str | Path, target_layer_ids: Sequence[int], *, n_parallel: int = 16,
                 n_ctx_seq: int = 1024, n_batch: int = 2048, n_ubatch: int = 512,
                 n_threads: Optional[int] = None, n_gpu_layers: int = 0, capture: str = "auto",
                 verbose: bool = False) -> None:
        if not Path(target_gguf).is_file():
            raise FileNotFoundError(f"no such GGUF file: {target_gguf}")
        from .._native_loader import native

        n = native()
        n.set_log_level(1 if verbose else 4)
        o = n.BatchCaptureOptions()
        o.target_path = str(target_gguf)
        o.target_layer_ids = [int(k) for k in target_layer_ids]
        o.n_parallel = int(n_parallel)
        o.n_ctx_seq = int(n_ctx_seq)
        o.n_batch = max(int(n_batch), int(n_parallel))
        o.n_ubatch = int(n_ubatch)
        o.n_threads = int(n_threads or 0)
        o.n_gpu_layers = int(n_gpu_layers)
        o.capture = capture
        self.target_path = str(target_gguf)
        self.target_layer_ids = tuple(o.target_layer_ids)
        self._native = n.BatchCapture(o)

    # -- the decoder-like surface :func:`dflash2_gguf.chat.templates.chat_prompt_ids` needs

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self._native.tokenize(text, add_special, parse_special)

    def chat_prompt_ids(self, text: str) -> list[int]:
        """Token ids of one user message, rendered and tokenized as the server does."""
        from ..chat.templates import chat_prompt_ids

        return chat_prompt_ids(self, [{"role": "user", "content": text}])

    # -- shape

    @property
    def n_embd(self) -> int:
        return self._native.n_embd

    @property
    def n_vocab(self) -> int:
        return self._native.n_vocab

    @property
    def capture_path(self) -> str:
        """``"layer_inp"`` or ``"cb_eval"``."""
        return self._native.capture_path

    @property
    def stats(self) -> dict:
        """Counters since the last :meth:`generate` started: ``n_prompt`` (prompt rows fed),
        ``n_generated``, ``n_decode`` (``llama_decode`` calls), ``t_decode_ms``, ``t_total_ms``."""
        return self._native.stats()

    # -- generation

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 keys: Optional[Sequence] = None) -> Iterator[CapturedSequence]:
        """Greedy answers with features, yielded in order of completion.

        Args:
            prompts: Token ids of each prompt (``0 < len < n_ctx_seq``, ``len <= n_batch``).
            max_new_tokens: Most generated tokens per answer (the EOG token counts); one for
                all prompts or one per prompt.
            keys: Identify the prompts in the results (default: their index).

        Raises:
            ValueError: a prompt is empty or does not fit (checked before anything runs).
            DecodeError: ``llama_decode`` failed.
        """
        nat = self._native
        nat.clear()
        nat.reset_stats()
        keys = list(range(len(prompts))) if keys is None else list(keys)
        if len(keys) != len(prompts):
            raise ValueError("keys and prompts differ in length")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ValueError("max_new_tokens and prompts differ in length")
        for i, p in enumerate(prompts):
            nat.submit(i, list(p), int(limits[i]))
        try:
            while not nat.idle:
                for i, prompt, response, features, why in nat.step():
                    yield CapturedSequence(keys[i], prompt, response, features, why)
        finally:
            nat.clear()  # an abandoned generator leaves no sequence behind

    def close(self) -> None:
        """Free the context, then the model. Safe to call more than once."""
        self._native.close()

    def __enter__(self) -> "BatchedCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------
# Shards
# ------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_responses(path: str | Path) -> dict[int, dict]:
    """The answers a capture recorded (``responses.jsonl``, or a gzipped copy ``*.jsonl.gz``):
    ``{i: {"i", "prompt", "response", "stop_reason"[, "family"]}}``, a later line for the same
    ``i`` replacing an earlier one. A missing file is an empty record; a line cut by a killed
    run (the last one) is skipped.

    Raises:
        ValueError: a line before the last one is not a JSON object with ``i``, ``prompt`` and
        ``response``.
    """
    import gzip

    path = Path(path)
    if not path.is_file():
        return {}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    out: dict[int, dict] = {}
    for n, line in enumerate(lines):
        try:
            r = json.loads(line)
            if not (isinstance(r["prompt"], list) and isinstance(r["response"], list)):
                raise TypeError("prompt and response must be lists of token ids")
            out[int(r["i"])] = r
        except (ValueError, KeyError, TypeError) as e:
            if n == len(lines) - 1:
                break  # the line a killed run was writing
            raise ValueError(f"{path}, line {n + 1}: not a recorded answer ({e})") from None
    return out


def generate_capture_shards(target_gguf: str | Path, prompts: Sequence[str], out_dir: str | Path,
                            target_layer_ids: Sequence[int], *, max_new_tokens: int = 256,
                            seqs_per_shard: int = 128, n_parallel: int = 16, n_ctx_seq: int = 1024,
                            n_batch: int = 2048, n_threads: Optional[int] = None, n_gpu_layers: int = 0,
                            capture: str = "auto", progress: bool = True, source: str = "",
                            max_shards: Optional[int] = None,
                            families: Optional[Sequence[str]] = None,
                            responses: Optional[str | Path] = None) -> list[Path]:
    """Feature shards of the target's greedy answers to ``prompts`` (user messages, the order
    given), ``seqs_per_shard`` prompts per shard; resumable.

    Shard ``k`` holds prompts ``k*seqs_per_shard .. (k+1)*seqs_per_shard - 1``; existing shards
    are kept (they must come from the same prompt order and ``seqs_per_shard``; their layer ids
    are checked) and only the missing ones are made, in one continuous-batching run
    (:class:`BatchedCapture`). Every answer is appended to ``<out_dir>/responses.jsonl`` (``i``,
    ``prompt``, ``response``) as it finishes. Logs tokens/s per shard to stderr. Returns the
    paths of all shards (but one whose prompts were all skipped). ``families``: the prompt family
    of each prompt (the mix's math / code / chat), kept per sequence in the shards (held-out tau
    per family) and in ``responses.jsonl``.

    Answers already recorded (in ``<out_dir>/responses.jsonl``, or in ``responses``: a
    ``responses.jsonl[.gz]`` kept from an earlier machine) are not generated again: prompt +
    answer go through the target in one teacher-forced prefill (features of every row, the same
    decode calls as the others), which costs a prompt's prefill instead of one decode per
    answer token. A recorded answer is used only when its prompt ids equal this prompt's
    rendering (the same position ``i`` of the same prompt order); the last row's features come
    from the token the target itself picks there, so when that is not the recorded last token
    (a near-tie under other batch shapes) the shard keeps the sequence without it, while
    ``responses.jsonl`` lists the recorded answer unchanged. Other arguments:
    :class:`BatchedCapture`.

    A prompt whose rendering leaves less than ``max_new_tokens`` cells of ``n_ctx_seq`` (or is
    longer than ``n_batch``) is skipped, with a count logged: its shard holds the other
    sequences of its range (the same ones on every rerun). A shard whose prompts are all skipped
    is not written.

    Raises:
        ValueError: an existing shard holds other target layers; ``families`` is not one per
        prompt; a responses file is damaged (:func:`read_responses`).
    """
    from .data import ShardMeta, read_shard_meta, write_shard

    prompts = list(prompts)
    if families is not None and len(families) != len(prompts):
        raise ValueError(f"{len(families)} families for {len(prompts)} prompts: give one per prompt")
    out = Path(out_dir)
    own = read_responses(out / "responses.jsonl")  # answers this folder already lists
    recorded = {**(read_responses(responses) if responses else {}), **own}
    out.mkdir(parents=True, exist_ok=True)
    ids = tuple(int(k) for k in target_layer_ids)
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
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=min(len(prompts), n_shards * seqs_per_shard),
                   initial=(n_shards - len(todo)) * seqs_per_shard, desc="data (sequences)",
                   dynamic_ncols=True, file=sys.stderr)
    with BatchedCapture(target_gguf, ids, n_parallel=n_parallel, n_ctx_seq=n_ctx_seq, n_batch=n_batch,
                        n_threads=n_threads, n_gpu_layers=n_gpu_layers, capture=capture) as gen:
        meta = ShardMeta(ids, gen.n_embd, gen.n_vocab, target=Path(target_gguf).name,
                         source=source or f"greedy batched ({n_parallel} parallel) "
                                          f"max_new_tokens={max_new_tokens} capture={gen.capture_path}")
        shard_of, left, need, ptoks, too_long = {}, {}, [], {}, []
        room = min(n_ctx_seq - max_new_tokens, n_batch)  # longest prompt that leaves a full answer
        for k in todo:
            lo, hi = k * seqs_per_shard, min(len(prompts), (k + 1) * seqs_per_shard)
            left[k] = 0
            for i in range(lo, hi):
                ptoks[i] = gen.chat_prompt_ids(prompts[i])
                if not 0 < len(ptoks[i]) <= room:
                    too_long.append(i)
                    continue
                shard_of[i] = k
                left[k] += 1
                need.append(i)
        if too_long:
            _log(f"skipping {len(too_long)} of {len(ptoks)} prompts longer than {room} tokens "
                 f"(n_ctx_seq {n_ctx_seq} - max_new_tokens {max_new_tokens}, at most n_batch "
                 f"{n_batch}), e.g. prompt {too_long[0]} ({len(ptoks[too_long[0]])} tokens): raise "
                 "n_ctx_seq to keep them")
        if bar is not None:
            bar.total -= len(too_long)
            bar.refresh()
        # a recorded answer to this very prompt: feed prompt + answer (but its last token), let
        # the target pick one token (its row is the last one's features)
        forced = {i: recorded[i]["response"] for i in need
                  if i in recorded and recorded[i]["prompt"] == ptoks[i] and recorded[i]["response"]}
        inputs = [ptoks[i] + forced[i][:-1] if i in forced else ptoks[i] for i in need]
        limits = [1 if i in forced else max_new_tokens for i in need]
        rows: dict[int, tuple] = {}
        t_start = time.perf_counter()
        n_new = n_forced = 0
        with open(out / "responses.jsonl", "a", encoding="utf-8") as rf:
            for seq in gen.generate(inputs, limits, keys=need):
                i = seq.key
                fam = {"family": families[i]} if families is not None else {}
                prompt = ptoks[i]
                if i in forced:
                    # the shard keeps the rows that have features: the answer's last token only if
                    # the target picks it again here (batched numerics may not); responses.jsonl
                    # keeps the recorded answer as it was, so a rebuild never rewrites one
                    response = forced[i] if seq.response == forced[i][-1:] else forced[i][:-1]
                    answer = forced[i]
                    n_forced += len(response)
                    stop = recorded[i].get("stop_reason", "")
                else:
                    response, stop = seq.response, seq.stop_reason
                    answer = response
                    n_new += len(response)
                if i not in own or i not in forced:  # responses.jsonl lists every answer once
                    rf.write(json.dumps({"i": i, **fam, "prompt": prompt, "response": answer,
                                         "stop_reason": stop}) + "\n")
                    rf.flush()
                n = len(prompt) + len(response)
                rows[i] = (prompt + response, seq.features[:n], len(prompt), *fam.values())
                if bar is not None:
                    bar.update(1)
                k = shard_of[i]
                left[k] -= 1
                if left[k]:
                    continue
                lo, hi = k * seqs_per_shard, min(len(prompts), (k + 1) * seqs_per_shard)
                seqs = [rows.pop(j) for j in range(lo, hi) if j in rows]  # skipped prompts: none
                write_shard(paths[k], seqs, meta)
                dt = time.perf_counter() - t_start
                _log(f"shard {k}: {len(seqs)} sequences -> {paths[k].name}; {n_new} new tokens in {dt:.0f} s "
                     f"= {n_new / dt:.1f} new tok/s, {n_forced} recorded answer tokens teacher-forced "
                     f"({n_parallel} parallel, capture {gen.capture_path})")
    if bar is not None:
        bar.close()
    return [p for p in paths if p.exists()]
