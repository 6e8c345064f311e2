"""OpenAI's endpoints:

- ``GET /v1/models`` (``/models``): the served model with ``aliases``, ``tags`` and ``meta``
  (``n_ctx``, ``n_ctx_train``, ``n_vocab``, ``n_embd``, ``n_params``, ``size``, ``vocab_type``,
  ``ftype``, plus ours: ``target``, ``drafter``, ``spec_type``, ``n_draft_max``).
- ``POST /v1/completions``: text completion; ``POST /v1/chat/completions`` (``/chat/completions``):
  chat completion, tools and reasoning parsed from the output (:mod:`dflash2_gguf.chat.output`).
  SSE streaming ends with ``data: [DONE]``; each response (the last chunk when streaming, every
  chunk with ``timings_per_token``) carries llama-server's ``timings`` with ``draft_n`` /
  ``draft_n_accepted`` and our ``acceptance_length``.
- ``POST /v1/responses`` (``/responses``): the Responses API, translated into a chat request
  (:mod:`.responses_api`) and run through the same pipeline.
- Token counts: ``/v1/chat/completions/input_tokens``, ``/v1/responses/input_tokens`` (both also
  without ``/v1``, as llama-server routes them).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Optional

from fastapi import APIRouter, Request

from . import compat, responses_api, web
from ..chat.output import finish_reason_for
from ..decoder.params import effective_spec_types
from .app import (_FINISH, BUILD_INFO, Service, _event_stream, _partial_timings, _progress, _sse, _timings, _usage,
                  parse_body, read_json, validate_body)
from .types import ChatCompletionRequest, CompletionRequest

__all__ = ["router"]


def router(svc: Service) -> APIRouter:
    """The OpenAI endpoints of the app of ``svc`` (its settings, worker and metrics)."""
    settings, worker, metrics, info = svc.settings, svc.worker, svc.metrics, svc.info
    r = APIRouter()

    created = int(time.time())

    def model_entry() -> dict:
        vt = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5, "plamo2": 6}
        return {
            "id": settings.model_id, "aliases": settings.aliases, "tags": settings.tag_list, "object": "model",
            "created": created, "owned_by": "llamacpp",
            "meta": {"vocab_type": vt.get(info.tokenizer_model, 0), "n_vocab": info.n_vocab, "n_ctx": settings.n_ctx,
                     "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd, "n_params": info.n_params,
                     "size": info.size, "ftype": info.ftype,
                     "target": Path(settings.model).name,
                     "drafter": Path(settings.model_draft).name if settings.model_draft else None,
                     "spec_type": ",".join(effective_spec_types(settings.spec_type, settings.model_draft is not None))
                                  or "none",
                     "n_draft_max": settings.n_draft_max},
        }

    @r.get("/v1/models")
    @r.get("/models")
    async def models():
        """The served model (llama-server's shape: ``models`` and ``data``)."""
        m = model_entry()
        return {"models": [{"name": m["id"], "model": m["id"], "modified_at": "", "size": "", "digest": "",
                            "type": "model", "description": "", "tags": m["tags"] or [""],
                            "capabilities": ["completion"], "parameters": "",
                            "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                        "parameter_size": "", "quantization_level": ""}}],
                "object": "list", "data": [m]}

    @r.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI text completion (llama-server's prompt forms and fields)."""
        metrics.request("/v1/completions")
        body = await parse_body(request, CompletionRequest)
        prompts = compat.split_prompts(body.prompt)
        done, jobs = await svc.generate(body, request, [svc.make_prepare(body, prompt=p) for p in prompts])
        cid, now, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), settings.model_id

        def obj(choices: list) -> dict:
            return {"choices": choices, "created": now, "model": model, "system_fingerprint": BUILD_INFO,
                    "object": "text_completion", "id": cid}

        def choice(i: int, text: str, finish: Optional[str], lp=None) -> dict:
            return {"text": text, "index": i, "logprobs": {"content": lp} if lp else None, "finish_reason": finish}

        if done is not None:
            out = obj([choice(i, c.text, _FINISH.get(c.stats.stop_reason, "stop"), c.logprobs)
                       for i, c in enumerate(done)])
            out["usage"] = _usage([c.stats for c in done])
            out["timings"] = _timings(done[0].stats)
            if svc.verbose_of(body):
                out["__verbose"] = svc.native_final(done[0], body, 0, stream=False)
            return out

        def on_start(i, job):
            lines = []
            for pp in (_progress(job) if body.return_progress else []):
                o = obj([choice(i, "", None)])
                if body.timings_per_token:
                    o["timings"] = _partial_timings(job, 0)
                o["prompt_progress"] = pp
                lines.append(_sse(o))
            return lines

        n_dec = {}

        def on_chunk(i, job, ch):
            n_dec[i] = n_dec.get(i, 0) + len(ch.tokens)
            if not ch.text and not body.timings_per_token:
                return []
            lp = compat.format_probs(worker.decoder, getattr(ch, "logprobs", None) or [], body.post_sampling_probs)
            o = obj([choice(i, ch.text, None, lp or None)])
            if body.timings_per_token:
                o["timings"] = _partial_timings(job, n_dec[i])
            return [_sse(o)]

        stats_seen = []

        def on_done(i, job, st):
            stats_seen.append(st)
            last = obj([choice(i, "", _FINISH.get(st.stop_reason, "stop"))])
            last["usage"] = _usage([st])  # llama-server: every final text-completion chunk has its usage
            last["timings"] = _timings(st)
            lines = [_sse(last)]
            if body.include_usage and i == len(jobs) - 1:
                u = obj([])
                u["usage"] = _usage(stats_seen)
                lines.append(_sse(u))
            return lines

        return _event_stream(svc.stream(jobs, on_chunk, on_done, on_start=on_start))

    @r.post("/v1/chat/completions")
    @r.post("/chat/completions")
    async def chat(request: Request):
        """OpenAI chat completion (prompt rendered with the chat template; tools and reasoning
        parsed from the output, see :mod:`dflash2_gguf.chat.output`)."""
        metrics.request("/v1/chat/completions")
        body = await parse_body(request, ChatCompletionRequest)
        done, jobs, plan = await svc.start_chat(body, request)
        cid, now, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), settings.model_id

        def obj(choices: list, object_: str = "chat.completion.chunk") -> dict:
            return {"choices": choices, "created": now, "id": cid, "model": model, "system_fingerprint": BUILD_INFO,
                    "object": object_}

        if done is not None:
            choices = []
            for i, c in enumerate(done):
                t = svc.turn_of(c, body, plan)
                msg: dict = {"role": "assistant", "content": t.content}
                if t.reasoning is not None:
                    msg["reasoning_content"] = t.reasoning
                if t.tool_calls:
                    msg["tool_calls"] = t.tool_calls
                ch = {"finish_reason": t.finish_reason, "index": i, "message": msg}
                if c.logprobs:  # llama-server leaves the key out when no logprobs were asked for
                    ch["logprobs"] = {"content": c.logprobs}
                choices.append(ch)
            out = obj(choices, "chat.completion")
            out["usage"] = _usage([c.stats for c in done])
            out["timings"] = _timings(done[0].stats)
            if svc.verbose_of(body):
                out["__verbose"] = svc.native_final(done[0], body, 0, stream=False)
            return out

        def delta(i: int, d: dict, finish: Optional[str]) -> dict:
            return {"finish_reason": finish, "index": i, "delta": d}

        outs: dict = {}
        marks: dict = {}

        def on_start(i, job):
            outs[i] = svc.chat_output(job, body, plan)
            if body.return_draft_marks:
                marks[i] = web.DraftMarks(worker.decoder, job.cycles)
            lines = []
            # llama-server: each progress event is the role delta with the timings and the progress
            for pp in (_progress(job) if body.return_progress else []):
                o = obj([delta(i, {"role": "assistant", "content": None}, None)])
                if body.timings_per_token:
                    o["timings"] = _partial_timings(job, 0)
                o["prompt_progress"] = pp
                lines.append(_sse(o))
            # then the first token's role delta, alone: the timings go on the token's last delta
            lines.append(_sse(obj([delta(i, {"role": "assistant", "content": None}, None)])))
            return lines

        n_dec = {}

        def on_chunk(i, job, ch):
            n_dec[i] = n_dec.get(i, 0) + len(ch.tokens)
            ds = outs[i].feed(ch.text)
            if not ds and not body.timings_per_token and not body.return_draft_marks:
                return []
            lines = []
            lp = compat.format_probs(worker.decoder, getattr(ch, "logprobs", None) or [], body.post_sampling_probs)
            for k, d in enumerate(ds or [{}]):
                o = obj([delta(i, d, None)])
                if k == len(ds or [{}]) - 1:  # llama-server: logprobs and timings on a chunk's last delta
                    if lp:
                        o["choices"][0]["logprobs"] = {"content": lp}
                    if body.timings_per_token:
                        o["timings"] = _partial_timings(job, n_dec[i])
                    if i in marks:
                        o["draft_marks"] = marks[i].chunk(ch)
                lines.append(_sse(o))
            return lines

        stats_seen = []

        def on_done(i, job, st):
            stats_seen.append(st)
            lines = []
            for d in outs[i].finish():
                lines.append(_sse(obj([delta(i, d, None)])))
            last = obj([delta(i, {}, finish_reason_for(st.stop_reason, outs[i].tool_calls))])
            last["timings"] = _timings(st)
            lines.append(_sse(last))
            if body.include_usage and i == len(jobs) - 1:
                u = obj([])
                u["usage"] = _usage(stats_seen)
                lines.append(_sse(u))
            return lines

        return _event_stream(svc.stream(jobs, on_chunk, on_done, on_start=on_start))

    @r.post("/v1/chat/completions/input_tokens")
    @r.post("/chat/completions/input_tokens")
    async def chat_input_tokens(request: Request):
        """llama-server's token count of a chat completion body."""
        body = await parse_body(request, ChatCompletionRequest)
        return responses_api.input_tokens_object(await svc.count_chat_tokens(body))

    @r.post("/v1/responses")
    @r.post("/responses")
    async def responses(request: Request):
        """OpenAI Responses API, translated to a chat request (:mod:`.responses_api`)."""
        metrics.request("/v1/responses")
        raw = await read_json(request)
        body = validate_body(responses_api.to_chat(raw), ChatCompletionRequest)
        done, jobs, plan = await svc.start_chat(body, request)
        if done is not None:
            return responses_api.response_object(raw, svc.turn_of(done[0], body, plan), settings.model_id)
        stream = responses_api.ResponsesStream(raw, settings.model_id)
        return _event_stream(stream.events(svc.turn_stream(jobs[0], body, plan)))

    @r.post("/v1/responses/input_tokens")
    @r.post("/responses/input_tokens")
    async def responses_input_tokens(request: Request):
        """llama-server's token count of a Responses body."""
        body = validate_body(responses_api.to_chat(await read_json(request)), ChatCompletionRequest)
        return responses_api.input_tokens_object(await svc.count_chat_tokens(body))

    return r
