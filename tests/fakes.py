"""A stand-in for :class:`dflash2_gguf.decoder.api.DFlashDecoder` that the server and parameter tests
share: no model, no native extension; every ``generate`` call's keywords are recorded."""

from __future__ import annotations

import time


class FakeDecoder:
    """Stands in for DFlashDecoder: ``mode`` "ok" yields two chunks ("a", "b"), "die" kills the
    worker. Tokens are characters (id = code point % 100); every generate's keywords are kept in
    ``calls``."""

    n_vocab = 100

    def __init__(self, mode: str = "ok", delay: float = 0.0) -> None:
        self.mode, self.delay = mode, delay
        self.calls = []

    def tokenize(self, text, add_special=True, parse_special=False):
        return ([1] if add_special else []) + [ord(c) % 100 for c in text]

    def detokenize(self, tokens, special=False):
        return "".join(chr(t) for t in tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def generate(self, stream=True, **kw):
        from dflash2_gguf.decoder.api import GenerationStats, StreamChunk

        self.calls.append(kw)
        if self.mode == "die":
            raise SystemExit("worker thread killed")  # not an Exception: ends the worker thread
        st = GenerationStats(len(kw.get("prompt") or [1]), 2, 1, 0, 0, 1.0, [], [], [], 0.0, 0.0, 0.0, 0.0, 0.0,
                             0.01, 200.0, 100.0, "length")
        yield StreamChunk("a", [1], [False], False)
        time.sleep(self.delay)
        yield StreamChunk("b", [2], [False], True, st)

    def close(self):
        pass
