"""Streaming detokenization (issue 44 item 3): incremental, linear, and token for token the text
of a one-shot detokenization, multi-byte characters split across tokens included."""

from __future__ import annotations

import codecs
import random

import pytest

from dflash2_gguf.decoder.detok import StreamingDetokenizer

TEXT = "Grüße aus Köln! 東京の天気は晴れです。🙂 Ça va? Ελληνικά — наука. " * 30


def _prefix_text(raw: bytes) -> str:
    """What a stream may have sent after ``raw``: its text less a trailing incomplete character."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=False)


class _ByteVocab:
    """A byte-level vocabulary (token = one byte, as byte-level BPE splits characters), counting the
    tokens each detokenization reads; ``spm=True`` drops the first token's leading space as
    libllama does for SentencePiece vocabularies (``add_space_prefix``)."""

    def __init__(self, spm: bool = False) -> None:
        self.spm = spm
        self.read = 0

    def detokenize(self, toks) -> bytes:
        self.read += len(toks)
        out = bytes(toks)
        return out[1:] if self.spm and out[:1] == b" " else out


@pytest.mark.parametrize("spm", [False, True])
def test_stream_equals_one_shot_token_for_token(spm):
    vocab = _ByteVocab(spm)
    ids = list((" " + TEXT).encode("utf-8"))
    rng = random.Random(0)
    d = StreamingDetokenizer(vocab.detokenize)
    sent, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 5)  # a cycle commits 1..5 tokens
        chunk = ids[i:i + n]
        i += n
        sent += d.feed(chunk, final=i >= len(ids))
        assert sent == _prefix_text(vocab.detokenize(ids[:i])), i  # never a half character, never late
    assert sent == vocab.detokenize(ids).decode("utf-8")
    assert d.n_fallbacks == 0


def test_cost_is_linear():
    """Each step reads the new tokens plus a fixed window, not the whole output."""
    vocab = _ByteVocab()
    ids = list(TEXT.encode("utf-8"))[:4000]
    d = StreamingDetokenizer(vocab.detokenize)
    for i in range(0, len(ids), 2):
        d.feed(ids[i:i + 2])
    # two detokenizations per step of at most window + 2 tokens: ~ 2 * 6 * 2000, not ~ 4000^2 / 4
    assert vocab.read <= 2 * (4 + 2) * (len(ids) // 2) + 2


def test_fallback_when_a_cleanup_reaches_past_the_window():
    """A vocabulary whose cleanup rewrites text far back (here: an 'X' anywhere upper-cases the
    whole text) still streams the one-shot text, through the whole-output fallback."""
    def detok(toks):
        s = bytes(toks).decode("latin-1")
        return (s.upper() if "X" in s else s).encode("latin-1")

    ids = list(b"abcdefgh") + [ord("X")]
    d = StreamingDetokenizer(detok, window=2)
    out = "".join(d.feed([t]) for t in ids[:-1]) + d.feed(ids[-1:], final=True)
    assert d.n_fallbacks == 1
    # what was sent stays sent (a stream cannot take text back); the fallback sends the rest
    assert out == "abcdefgh" + "X"
    with pytest.raises(ValueError):
        StreamingDetokenizer(detok, window=0)


@pytest.mark.native
def test_long_multibyte_output_streams_as_one_shot(native_ext, smollm2_gguf):
    """SmolLM2 (byte-level BPE) made to write 400 tokens of CJK and emoji by a grammar: every
    chunk's text is exactly what the one-shot detokenization of the tokens so far has gained, and
    the whole stream is ``generate``'s text."""
    from dflash2_gguf import DFlashDecoder, SamplingParams

    grammar = 'root ::= ([一-龥] | [ぁ-ゟ] | [😀-🙏] | "、")+'
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3, grammar=grammar)
    with DFlashDecoder(str(smollm2_gguf), None, n_ctx=1024, n_threads=1) as dec:
        chunks = list(dec.generate("Write in Japanese:", max_tokens=400, sampling=sp, ignore_eos=True, stream=True))
        toks, sent = [], ""
        for ch in chunks:
            toks += ch.tokens
            sent += ch.text
            raw = bytes(dec.engine.detokenize(toks, False))
            assert sent == (raw.decode("utf-8", errors="replace") if ch.done else _prefix_text(raw))
        assert len(toks) == 400
        assert sum(len(c.encode("utf-8")) > 1 for c in sent) > 100  # multi-byte characters, many
        one = dec.generate("Write in Japanese:", max_tokens=400, sampling=sp, ignore_eos=True)
        assert one.tokens == toks and one.text == sent
