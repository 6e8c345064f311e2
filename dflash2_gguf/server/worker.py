"""The model worker: N slots (``--parallel N``), each ONE thread owning its own decoder.

After mlx-lm's ``server.py``: HTTP handlers never touch a decoder. They build a :class:`Job`
(the generation keywords plus a response queue of their own) and :meth:`Worker.submit` it; slot
threads take jobs from one FIFO request queue (or, for a job pinned with llama-server's
``id_slot``, from that slot's own queue) and run them one at a time, so two generations never
share a decoder. Each job's results go to its own ``asyncio.Queue`` through
``loop.call_soon_threadsafe``:

    ("chunk", StreamChunk)   one per draft/verify cycle (the last has ``done`` and ``stats``)
    ("error", exception)     the generation failed (the slot goes on with the next job)
    ("cancelled", n_tokens)  the job was cancelled (before it started: 0 tokens)

Slots. llama-server's ``--parallel N`` gives N slots that share one model and one KV cache and are
batched together in each target pass. The native driver runs one sequence per context, so here
each slot loads its own :class:`~dflash2_gguf.decoder.api.DFlashDecoder` (target + drafter + their
contexts). On CPU the GGUF weights are memory-mapped, so the N loads share the same page-cache
pages and cost little extra RAM; each slot does own its KV caches (N x the KV memory of one), and
on a GPU each slot holds its own copy of the offloaded layers. The slots run concurrently in
their own threads (each with ``n_threads`` CPU threads), without batching across slots. Slots
load one after the other; ``/health`` answers 503 "loading model" until all are ready.

Cancellation (a client that disconnects) sets ``Job.cancelled``; the slot checks it before a job
starts and between stream chunks, and closes the decoder's stream (which releases the decoder)
instead of running to ``max_tokens``. The HTTP side waits on its queue with a timeout and checks
:attr:`Worker.alive` on each timeout, so a dead worker cannot hang a client.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .errors import APIError
from .metrics import Metrics
from .web import cycle_counts

__all__ = ["Job", "Slot", "Worker"]

log = logging.getLogger("dflash2_gguf.server")

_ids = itertools.count(1)


@dataclass
class Job:
    """One generation request.

    Attributes:
        kwargs: Keywords of :meth:`DFlashDecoder.generate` (``prompt`` or ``messages``,
            ``max_tokens``, ``sampling``, ``stop``, ``n_draft_max``, ``use_drafter``,
            ``ignore_eos``); ``stream=True`` is added by the slot.
        loop: The event loop of the HTTP handler that waits for the results.
        prepare: Optional ``prepare(decoder, job) -> kwargs``, run in the slot thread before the
            generation (tokenizing, chat rendering, context checks: see :mod:`.compat`); its result
            replaces ``kwargs``. It may raise an :class:`APIError`. ``max_tokens == 0`` in the
            result evaluates nothing and returns an empty completion (llama-server's
            ``n_predict: 0``).
        id_slot: llama-server's ``id_slot``: -1 = the first free slot, else that slot.
        params: The request's generation settings, shown by ``GET /slots``.
        info: Filled by ``prepare`` (``prompt`` text, ``n_prompt``), read by the handler after the end.
        out: The job's response queue (filled from the slot thread).
        cancelled: Set to stop the generation at the next chunk boundary.
        cycles: Per posted chunk with tokens, the drafter's counters after it (``(n_drafted,
            n_cached)``, :func:`.web.cycle_counts`; nothing for decoders without native stats), for
            the stream's ``draft_marks`` (:class:`.web.DraftMarks`).
    """

    kwargs: dict
    loop: asyncio.AbstractEventLoop
    prepare: Optional[Callable[[Any, "Job"], dict]] = None
    id_slot: int = -1
    params: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = field(default_factory=lambda: next(_ids))
    cycles: collections.deque = field(default_factory=collections.deque)
    t_submit: float = field(default_factory=time.perf_counter)

    def post(self, kind: str, value: Any) -> None:
        """Hand one result to the waiting handler (thread-safe; dropped if its loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            self.cancelled.set()

    def cancel(self) -> None:
        """Ask the slot to stop this job (before it starts, or at the next chunk)."""
        self.cancelled.set()


_STOP = object()


@dataclass
class Slot:
    """One slot: a thread, its decoder and what it is doing (``GET /slots``).

    Attributes:
        id: Slot index (0..N-1).
        decoder: The slot's decoder (None until loaded).
        job: The job running now, or None.
        n_decoded: Tokens generated so far by the running job.
        has_new_line: Whether the running job's text has a newline yet.
        last_params: Generation settings of the running (or last) job.
        last_job: The running (or last) job; None until the slot's first task (llama-server's
            ``/slots`` shows a slot's task fields only once it has had one).
    """

    id: int
    decoder: Any = None
    job: Optional[Job] = None
    n_decoded: int = 0
    has_new_line: bool = False
    last_params: dict = field(default_factory=dict)
    last_job: Optional[Job] = None
    own: "queue.Queue[Any]" = field(default_factory=queue.Queue)
    thread: Optional[threading.Thread] = None

    @property
    def busy(self) -> bool:
        """True while a job runs on this slot."""
        return self.job is not None


class Worker:
    """N slots, each owning a decoder in its own thread, running queued jobs.

    Args:
        load: Called once per slot in that slot's thread (one slot at a time); returns the
            decoder (a ``DFlashDecoder`` or any object with its ``generate(..., stream=True)``
            and ``close()``).
        metrics: Counters updated per job.
        max_queue: Jobs waiting beyond this are refused with 503 ``server_busy``.
        n_slots: Number of slots (``--parallel``; >= 1).
    """

    def __init__(self, load: Callable[[], Any], metrics: Optional[Metrics] = None, *, max_queue: int = 64,
                 n_slots: int = 1) -> None:
        if n_slots < 1:
            raise ValueError("n_slots must be >= 1")
        self._load = load
        self.metrics = metrics or Metrics()
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=max_queue)
        self.max_queue = max_queue
        self.slots = [Slot(i) for i in range(n_slots)]
        self._stopping = threading.Event()
        self._load_lock = threading.Lock()
        self._started = False
        self.state = "created"  # created -> loading -> ready | failed ; -> stopped
        self.load_error: Optional[BaseException] = None
        self._n_loaded = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the slot threads (each loads its decoder, then serves the queues)."""
        if self._started:
            raise RuntimeError("worker already started")
        self._started = True
        self.state = "loading"
        for s in self.slots:
            s.thread = threading.Thread(target=self._run, args=(s,), name=f"dflash2-slot-{s.id}", daemon=True)
            s.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel queued jobs and the running ones (at their next chunk), close the decoders, join."""
        self._stopping.set()
        for s in self.slots:
            if s.job is not None:
                s.job.cancel()
        for q in [self._queue] + [s.own for s in self.slots]:
            while True:
                try:
                    job = q.get_nowait()
                except queue.Empty:
                    break
                if job is not _STOP:
                    job.cancel()
                    job.post("error", APIError(503, "the server is shutting down", "unavailable_error", None,
                                               "unavailable"))
        deadline = time.monotonic() + timeout
        for s in self.slots:
            if s.thread is not None:
                s.thread.join(max(deadline - time.monotonic(), 0.1))

    @property
    def alive(self) -> bool:
        """True while every slot thread runs with a loaded model."""
        return self.state == "ready" and all(s.thread is not None and s.thread.is_alive() for s in self.slots)

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the running ones)."""
        return self._queue.qsize() + sum(s.own.qsize() for s in self.slots)

    @property
    def busy(self) -> int:
        """Slots running a job now."""
        return sum(1 for s in self.slots if s.busy)

    @property
    def decoder(self) -> Any:
        """Slot 0's decoder, for read-only vocabulary work (tokenize, detokenize, templates)."""
        return self.slots[0].decoder

    def submit(self, job: Job) -> None:
        """Queue ``job`` (on its ``id_slot``'s own queue when pinned).

        Raises:
            APIError: 503 when the model is loading, failed to load, a slot died, or the queue
                is full; 400 for an ``id_slot`` outside [-1, N).
        """
        if not self.alive:
            raise APIError(503, self.unavailable_reason(), "unavailable_error", None, "unavailable")
        if not (-1 <= job.id_slot < len(self.slots)):
            raise APIError(400, f"Invalid slot ID {job.id_slot}: this server has {len(self.slots)} slot(s) "
                                f"(--parallel); use -1 for any", "invalid_request_error", "id_slot", "invalid_value")
        if self.queued >= self.max_queue:
            raise APIError(503, "too many queued requests, retry later", "unavailable_error", None, "server_busy")
        try:
            (self._queue if job.id_slot < 0 else self.slots[job.id_slot].own).put_nowait(job)
        except queue.Full:
            raise APIError(503, "too many queued requests, retry later", "unavailable_error", None,
                           "server_busy") from None
        self.metrics.set_queue(self.queued)

    def unavailable_reason(self) -> str:
        """Why the worker does not take jobs (for /health and 503 errors)."""
        if self.state == "loading":
            return "loading model"
        if self.state == "failed":
            return f"model failed to load: {self.load_error}"
        if self.state == "stopped":
            return "the server is shutting down"
        if not all(s.thread is not None and s.thread.is_alive() for s in self.slots):
            return "the model worker is not running"
        return "ok"

    # ------------------------------------------------------------------ threads

    def _next_job(self, slot: Slot) -> Any:
        try:
            return slot.own.get_nowait()
        except queue.Empty:
            pass
        try:
            return self._queue.get(timeout=0.05)
        except queue.Empty:
            return None

    def _run(self, slot: Slot) -> None:
        try:
            with self._load_lock:
                if self.state == "failed" or self._stopping.is_set():
                    return
                slot.decoder = self._load()
        except BaseException as e:  # noqa: BLE001 - reported through /health
            log.exception("model load failed (slot %d)", slot.id)
            self.load_error = e
            self.state = "failed"
            return
        with self._lock:
            self._n_loaded += 1
            if self._n_loaded == len(self.slots) and self.state == "loading":
                self.state = "ready"
        try:
            while not self._stopping.is_set():
                job = self._next_job(slot)
                if job is None:
                    continue
                self.metrics.set_queue(self.queued)
                self._process(slot, job)
        finally:
            if self.state != "failed":
                self.state = "stopped"
            dec, slot.decoder = slot.decoder, None
            if dec is not None:
                try:
                    dec.close()
                except Exception:  # pragma: no cover
                    log.exception("decoder close failed")

    def _process(self, slot: Slot, job: Job) -> None:
        if job.cancelled.is_set():
            self.metrics.cancelled(0)
            job.post("cancelled", 0)
            return
        it = None
        n = 0
        slot.job, slot.n_decoded, slot.has_new_line, slot.last_params = job, 0, False, job.params
        slot.last_job = job
        job.info["id_slot"] = slot.id
        self.metrics.set_processing(self.busy)
        try:
            kwargs = job.prepare(slot.decoder, job) if job.prepare is not None else job.kwargs
            prompt = kwargs.get("prompt")
            if isinstance(prompt, list):
                nv = int(slot.decoder.n_vocab)
                bad = [t for t in prompt if not (0 <= int(t) < nv)]
                if bad:
                    raise APIError(400, f"prompt token id {bad[0]} out of range [0, {nv})", "invalid_request_error",
                                   "prompt", "invalid_value")
            if kwargs.get("max_tokens") == 0:  # llama-server's n_predict 0: evaluate nothing, return nothing
                job.post("chunk", _empty_final(len(prompt) if isinstance(prompt, list) else 0))
                return
            it = slot.decoder.generate(stream=True, **kwargs)
            for ch in it:
                n += len(ch.tokens)
                slot.n_decoded = n
                slot.has_new_line = slot.has_new_line or "\n" in ch.text
                if ch.tokens:
                    counts = cycle_counts(slot.decoder)
                    if counts is not None:
                        job.cycles.append(counts)  # before the post: the handler reads it with the chunk
                job.post("chunk", ch)
                if ch.done:
                    job.info["n_cached"] = int(getattr(ch.stats, "n_cached", 0) or 0)
                    self.metrics.finished(ch.stats)
                    return
                if job.cancelled.is_set():
                    self.metrics.cancelled(n)
                    job.post("cancelled", n)
                    return
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the slot
            self.metrics.failed()
            job.post("error", e)
        finally:
            if it is not None and hasattr(it, "close"):
                it.close()  # releases the decoder's lock if the stream stopped early
            slot.job = None
            self.metrics.set_processing(self.busy)


def _empty_final(n_prompt: int) -> Any:
    """The one chunk of an ``n_predict: 0`` request (nothing generated)."""
    from ..decoder.api import GenerationStats, StreamChunk

    st = GenerationStats(n_prompt, 0, 0, 0, 0, 0.0, [], [], [], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "length")
    return StreamChunk("", [], [], True, st)
