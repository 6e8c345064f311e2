"""The model worker: ONE thread owns the :class:`~dflash2_gguf.api.DFlashDecoder`.

After mlx-lm's ``server.py``: HTTP handlers never touch the decoder. They build a :class:`Job`
(the generation keywords plus a response queue of their own) and :meth:`Worker.submit` it; the
worker thread takes jobs from one FIFO request queue and runs them one at a time, so two
generations never share the decoder. Each job's results go to its own ``asyncio.Queue`` through
``loop.call_soon_threadsafe``:

    ("chunk", StreamChunk)   one per draft/verify cycle (the last has ``done`` and ``stats``)
    ("error", exception)     the generation failed (the worker goes on with the next job)
    ("cancelled", n_tokens)  the job was cancelled (before it started: 0 tokens)

Cancellation (a client that disconnects) sets ``Job.cancelled``; the worker checks it before a
job starts and between stream chunks, and closes the decoder's stream (which releases the
decoder) instead of running to ``max_tokens``. The HTTP side waits on its queue with a timeout
and checks :attr:`Worker.alive` on each timeout, so a dead worker cannot hang a client.

The worker loads the model in its own thread (``/health`` answers 503 "loading" meanwhile).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .errors import APIError
from .metrics import Metrics

__all__ = ["Job", "Worker"]

log = logging.getLogger("dflash2_gguf.server")

_ids = itertools.count(1)


@dataclass
class Job:
    """One generation request.

    Attributes:
        kwargs: Keywords of :meth:`DFlashDecoder.generate` (``prompt`` or ``messages``,
            ``max_tokens``, ``sampling``, ``stop``, ``n_draft_max``, ``use_drafter``,
            ``ignore_eos``); ``stream=True`` is added by the worker.
        loop: The event loop of the HTTP handler that waits for the results.
        out: The job's response queue (filled from the worker thread).
        cancelled: Set to stop the generation at the next chunk boundary.
    """

    kwargs: dict
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = field(default_factory=lambda: next(_ids))
    t_submit: float = field(default_factory=time.perf_counter)

    def post(self, kind: str, value: Any) -> None:
        """Hand one result to the waiting handler (thread-safe; dropped if its loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            self.cancelled.set()

    def cancel(self) -> None:
        """Ask the worker to stop this job (before it starts, or at the next chunk)."""
        self.cancelled.set()


_STOP = object()


class Worker:
    """Owns the decoder in one thread and runs queued jobs one at a time.

    Args:
        load: Called once in the worker thread; returns the decoder (a ``DFlashDecoder`` or any
            object with its ``generate(..., stream=True)`` and ``close()``).
        metrics: Counters updated per job.
        max_queue: Jobs waiting beyond this are refused with 503 ``server_busy``.
    """

    def __init__(self, load: Callable[[], Any], metrics: Optional[Metrics] = None, *, max_queue: int = 64) -> None:
        self._load = load
        self.metrics = metrics or Metrics()
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=max_queue)
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self.state = "created"  # created -> loading -> ready | failed ; -> stopped
        self.load_error: Optional[BaseException] = None
        self.decoder: Any = None
        self.busy = False
        self._current: Optional[Job] = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the worker thread (it loads the model, then serves the queue)."""
        if self._thread is not None:
            raise RuntimeError("worker already started")
        self.state = "loading"
        self._thread = threading.Thread(target=self._run, name="dflash2-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel queued jobs and the running one (at its next chunk), close the decoder, join."""
        self._stopping.set()
        cur = self._current
        if cur is not None:
            cur.cancel()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job.cancel()
                job.post("error", APIError(503, "the server is shutting down", "server_error", None, "unavailable"))
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the worker thread runs with a loaded model."""
        return self.state == "ready" and self._thread is not None and self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            APIError: 503 when the model is loading, failed to load, the worker died, or the
                queue is full.
        """
        if not self.alive:
            raise APIError(503, self.unavailable_reason(), "server_error", None, "unavailable")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(503, "too many queued requests, retry later", "server_error", None, "server_busy") from None
        self.metrics.set_queue(self.queued)

    def unavailable_reason(self) -> str:
        """Why the worker does not take jobs (for /health and 503 errors)."""
        if self.state == "loading":
            return "loading model"
        if self.state == "failed":
            return f"model failed to load: {self.load_error}"
        if self.state == "stopped":
            return "the server is shutting down"
        if self._thread is None or not self._thread.is_alive():
            return "the model worker is not running"
        return "ok"

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        try:
            self.decoder = self._load()
        except BaseException as e:  # noqa: BLE001 - reported through /health
            log.exception("model load failed")
            self.load_error = e
            self.state = "failed"
            return
        self.state = "ready"
        try:
            while not self._stopping.is_set():
                try:
                    job = self._queue.get(timeout=0.5)
                except queue.Empty:
                    continue
                if job is _STOP:
                    break
                self.metrics.set_queue(self.queued)
                self._process(job)
        finally:
            self.state = "stopped"
            dec, self.decoder = self.decoder, None
            if dec is not None:
                try:
                    dec.close()
                except Exception:  # pragma: no cover
                    log.exception("decoder close failed")

    def _process(self, job: Job) -> None:
        if job.cancelled.is_set():
            self.metrics.cancelled(0)
            job.post("cancelled", 0)
            return
        it = None
        n = 0
        self._current = job
        self.busy = True
        self.metrics.set_busy(True)
        try:
            prompt = job.kwargs.get("prompt")
            if isinstance(prompt, list):
                nv = int(self.decoder.n_vocab)
                bad = [t for t in prompt if not (0 <= int(t) < nv)]
                if bad:
                    raise ValueError(f"prompt token id {bad[0]} out of range [0, {nv})")
            it = self.decoder.generate(stream=True, **job.kwargs)
            for ch in it:
                n += len(ch.tokens)
                job.post("chunk", ch)
                if ch.done:
                    self.metrics.finished(ch.stats)
                    return
                if job.cancelled.is_set():
                    self.metrics.cancelled(n)
                    job.post("cancelled", n)
                    return
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the worker
            self.metrics.failed()
            job.post("error", e)
        finally:
            if it is not None and hasattr(it, "close"):
                it.close()  # releases the decoder's lock if the stream stopped early
            self._current = None
            self.busy = False
            self.metrics.set_busy(False)
