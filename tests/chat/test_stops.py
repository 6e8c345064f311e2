"""Stop strings in streaming (dflash2_gguf.chat.stops.StopStringBuffer): on many random splits the
streamed text equals the non-streamed cut text and never contains a stop-string prefix that is cut."""

from __future__ import annotations

import random

from dflash2_gguf.chat.stops import StopStringBuffer


def _cut(text, stops):
    """The non-streamed rule (DFlashDecoder.generate): cut before the earliest stop occurrence."""
    idx = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(idx)] if idx else text


def _run(text, stops, rng):
    """Stream ``text`` in random pieces, stopping as the driver does (at the piece completing a stop).
    Returns (pieces sent, text the driver had produced)."""
    buf = StopStringBuffer(stops)
    sent, fed, i = [], "", 0
    while i < len(text):
        k = rng.randint(1, 5)
        piece = text[i:i + k]
        i += k
        fed += piece
        sent.append(buf.feed(piece))
        if buf.stopped:
            return sent, fed
    sent.append(buf.flush())
    return sent, fed


def test_examples():
    b = StopStringBuffer(["</s>", "\n\nUser:"])
    assert b.feed("Hello <") == "Hello "
    assert b.feed("/") == ""
    assert b.feed("b> ok\n") == "</b> ok"
    assert b.feed("\nUs") == ""
    assert b.feed("er: next") == "" and b.stopped and b.stop_string == "\n\nUser:"
    assert b.flush() == ""
    b = StopStringBuffer([])
    assert b.feed("abc") == "abc" and b.flush() == ""
    b = StopStringBuffer(["xyz"])
    assert b.feed("ab xy") == "ab " and b.flush() == "xy" and not b.stopped


def test_random_splits_property():
    rng = random.Random(20261201)
    alphabet = "ab</>\n "
    n_stopped = 0
    for trial in range(3000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        sent, fed = _run(text, stops, rng)
        streamed = "".join(sent)
        want = _cut(fed, stops)
        assert streamed == want, (text, stops, sent)
        n_stopped += fed != text or want != fed
        # no piece ever sent is taken back: every prefix of the stream is a prefix of the result,
        # so a stop string's first characters that were cut were never sent
        acc = ""
        for piece in sent:
            acc += piece
            assert want.startswith(acc)
        # when the driver would not stop early (the stop completes only at the end), the stream
        # equals the cut of the whole text
        if fed == text:
            assert streamed == _cut(text, stops)
    assert n_stopped > 500  # the property was exercised with stops found, not only pass-through
