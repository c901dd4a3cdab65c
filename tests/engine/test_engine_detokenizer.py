"""Incremental detokenizer: whole characters only, and the join equals the one-shot decode."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fakes import EOS, EOT, FakeTokenizer

from flm_runtime.text.detokenizer import Detokenizer, detokenize

SAMPLES = {
    "chinese": "你好，世界",
    "korean": "안녕하세요",
    "emoji": "ok 😀🎉!",
    "zwj_family": "👨\u200d👩\u200d👧\u200d👦 family",
    "flag_and_skin_tone": "🇫🇷 👍🏽",
    "combining": "e\u0301 cafe\u0301",
}


def _split(data: bytes, cuts) -> list[bytes]:
    cuts = sorted(set(c for c in cuts if 0 < c < len(data)))
    return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]


def _run(pieces: list[bytes]) -> tuple[list[str], str]:
    """Push each byte string as one token of a fake vocabulary; returns (outputs, flush)."""
    tok = FakeTokenizer(extra=[p for p in dict.fromkeys(pieces) if len(p) > 1])
    detok = Detokenizer(tok.token_bytes)
    outs = [detok.push(tok.id_of(p)) for p in pieces]
    return outs, detok.flush()


@pytest.mark.parametrize("name", SAMPLES)
def test_every_byte_split_gives_whole_characters(name):
    data = SAMPLES[name].encode()
    for cut in range(1, len(data)):
        for cut2 in (cut + 1, cut + 2, len(data)):
            outs, tail = _run(_split(data, [cut, cut2]))
            assert "".join(outs) + tail == SAMPLES[name]
            assert tail == ""
            done = 0
            for piece in outs:              # each output is a run of whole characters of the text
                assert SAMPLES[name][done:done + len(piece)] == piece
                done += len(piece)


def test_a_character_is_emitted_by_the_token_that_completes_it():
    data = "😀".encode()
    outs, _ = _run([data[i:i + 1] for i in range(4)])
    assert outs == ["", "", "", "😀"]
    outs, _ = _run([b"a" + data[:2], data[2:] + "好".encode()[:1], "好".encode()[1:]])
    assert outs == ["a", "😀", "好"]


def test_zwj_sequence_split_between_code_points():
    text = SAMPLES["zwj_family"]
    data = text.encode()
    zwj_at = data.index("\u200d".encode())
    outs, _ = _run([data[: zwj_at + 1], data[zwj_at + 1:]])   # cut inside the ZWJ itself
    assert outs[0] == "👨" and "".join(outs) == text


def test_random_splits_with_invalid_bytes_match_decode_replace():
    rng = np.random.default_rng(0)
    text = "".join(SAMPLES.values()).encode()
    junk = [b"\xff", b"\xc3", b"\xe4\xbd", b"\xf0\x9f\x98", b"\x80", b"\xed\xa0\x80"]
    for _ in range(300):
        parts = [text[: rng.integers(1, 40)]] + [junk[rng.integers(len(junk))] for _ in range(3)] + [text[-30:]]
        data = b"".join(rng.permutation(np.array(parts, dtype=object)))
        if rng.random() < 0.5:
            data += junk[rng.integers(len(junk))]        # a tail that never completes
        outs, tail = _run(_split(data, rng.integers(1, len(data), size=rng.integers(1, 12))))
        assert "".join(outs) + tail == data.decode("utf-8", errors="replace")


def test_dangling_tail_becomes_one_replacement_at_flush():
    outs, tail = _run([b"a", "😀".encode()[:3]])
    assert outs == ["a", ""] and tail == "\ufffd"
    assert "".join(outs) + tail == b"a\xf0\x9f\x98".decode("utf-8", errors="replace")


def test_skip_ids_emit_nothing_and_join_equals_detokenize():
    tok = FakeTokenizer(extra=["你好".encode(), b" world"])
    ids = [tok.id_of("你好"), EOS, tok.id_of(" world"), EOT]
    detok = Detokenizer(tok.token_bytes, skip_ids=tok.stop_token_ids)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    assert out == "你好 world" == tok.decode(ids)
    assert detokenize(tok.token_bytes, ids[:1] + ids[2:3]) == out
