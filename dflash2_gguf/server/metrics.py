"""Server counters, rendered as Prometheus text for ``GET /metrics``.

Names (all prefixed ``dflash2_``; llama-server's ``llamacpp:*`` counterparts in brackets):

- ``requests_total{endpoint}``: HTTP generation requests received.
- ``requests_finished_total`` / ``requests_failed_total`` / ``requests_cancelled_total``:
  generations run to the end, failed (e.g. context overflow), cancelled by a disconnect.
- ``prompt_tokens_total`` [``prompt_tokens_total``], ``generated_tokens_total``
  [``tokens_predicted_total``]: tokens of finished generations.
- ``cancelled_generated_tokens_total``: tokens produced by generations that were cancelled
  (so a test can see a cancelled request did not run to ``max_tokens``).
- ``draft_tokens_total`` / ``draft_accepted_tokens_total``: drafts verified / accepted.
- ``acceptance_length``: mean over finished requests of their acceptance length tau (tokens
  committed per target pass, bonus included; averaged per request, then over requests).
- ``tokens_per_second``: tokens/s of the last finished generation (prefill included)
  [``predicted_tokens_seconds``]; ``decode_tokens_per_second``: same without the prefill.
- ``requests_processing`` / ``requests_queued`` [``requests_processing`` / ``requests_deferred``].
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["Metrics"]


class Metrics:
    """Thread-safe counters of the server (updated by the worker and the HTTP handlers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = Counter()
        self.n_finished = 0
        self.n_failed = 0
        self.n_cancelled = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cancelled_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.tau_sum = 0.0
        self.tau_n = 0
        self.last_tps = 0.0
        self.last_decode_tps = 0.0
        self.processing = 0
        self.queued = 0

    def request(self, endpoint: str) -> None:
        """Count one request received on ``endpoint``."""
        with self._lock:
            self.requests[endpoint] += 1

    def finished(self, stats: Any) -> None:
        """Record a generation that ran to its end (``stats``: GenerationStats)."""
        with self._lock:
            self.n_finished += 1
            self.prompt_tokens += int(stats.n_prompt)
            self.generated_tokens += int(stats.n_generated)
            self.drafted += int(stats.n_drafted)
            self.accepted += int(stats.n_accepted)
            if stats.n_cycles:
                self.tau_sum += float(stats.acceptance_length)
                self.tau_n += 1
            self.last_tps = float(stats.tokens_per_second)
            self.last_decode_tps = float(stats.decode_tokens_per_second)

    def failed(self) -> None:
        """Record a generation that raised."""
        with self._lock:
            self.n_failed += 1

    def cancelled(self, n_tokens: int) -> None:
        """Record a generation cancelled after ``n_tokens`` tokens."""
        with self._lock:
            self.n_cancelled += 1
            self.cancelled_tokens += int(n_tokens)

    def set_processing(self, n: int) -> None:
        """Generations running now (one per busy slot)."""
        with self._lock:
            self.processing = int(n)

    def set_queue(self, n: int) -> None:
        """Jobs waiting in the worker's queue."""
        with self._lock:
            self.queued = int(n)

    def snapshot(self) -> dict:
        """All values as a dict (``name -> value``; ``requests_total`` -> {endpoint: n})."""
        with self._lock:
            return {
                "requests_total": dict(self.requests),
                "requests_finished_total": self.n_finished,
                "requests_failed_total": self.n_failed,
                "requests_cancelled_total": self.n_cancelled,
                "prompt_tokens_total": self.prompt_tokens,
                "generated_tokens_total": self.generated_tokens,
                "cancelled_generated_tokens_total": self.cancelled_tokens,
                "draft_tokens_total": self.drafted,
                "draft_accepted_tokens_total": self.accepted,
                "acceptance_length": (self.tau_sum / self.tau_n) if self.tau_n else 0.0,
                "tokens_per_second": self.last_tps,
                "decode_tokens_per_second": self.last_decode_tps,
                "requests_processing": self.processing,
                "requests_queued": self.queued,
            }

    _HELP = {
        "requests_total": ("counter", "HTTP generation requests received"),
        "requests_finished_total": ("counter", "generations run to their end"),
        "requests_failed_total": ("counter", "generations that failed"),
        "requests_cancelled_total": ("counter", "generations cancelled by a client disconnect"),
        "prompt_tokens_total": ("counter", "prompt tokens of finished generations"),
        "generated_tokens_total": ("counter", "tokens generated by finished generations"),
        "cancelled_generated_tokens_total": ("counter", "tokens generated by cancelled generations"),
        "draft_tokens_total": ("counter", "draft tokens verified by the target"),
        "draft_accepted_tokens_total": ("counter", "draft tokens accepted"),
        "acceptance_length": ("gauge", "mean acceptance length (tokens per target pass, bonus included)"),
        "tokens_per_second": ("gauge", "tokens/s of the last finished generation, prefill included"),
        "decode_tokens_per_second": ("gauge", "decode tokens/s of the last finished generation"),
        "requests_processing": ("gauge", "generations running (one per busy slot, at most --parallel)"),
        "requests_queued": ("gauge", "requests waiting for the worker"),
    }

    def prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        snap = self.snapshot()
        lines = []
        for name, (kind, help_) in self._HELP.items():
            full = f"dflash2_{name}"
            lines.append(f"# HELP {full} {help_}")
            lines.append(f"# TYPE {full} {kind}")
            v = snap[name]
            if isinstance(v, dict):
                for ep, n in sorted(v.items()):
                    lines.append(f'{full}{{endpoint="{ep}"}} {n}')
                if not v:
                    lines.append(f'{full}{{endpoint="none"}} 0')
            else:
                lines.append(f"{full} {v:g}" if isinstance(v, float) else f"{full} {v}")
        return "\n".join(lines) + "\n"
