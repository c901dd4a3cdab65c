"""Stop strings, EOS / end-of-turn ids, the budget, and which tokens count as delivered."""

from __future__ import annotations

import numpy as np
import pytest
from engine_fakes import EOS, EOT, FakeTokenizer

from flm_runtime.text.detokenizer import Detokenizer
from flm_runtime.text.stop import StopChecker, StopStringMatcher


def _match(stop, chunks):
    m = StopStringMatcher(stop)
    outs = []
    for c in chunks:
        text, hit = m.push(c)
        outs.append(text)
        if hit:
            return outs, True
    outs.append(m.flush())
    return outs, False


def test_stop_string_split_across_chunks():
    outs, hit = _match(["WORLD"], ["Hel", "lo WO", "RLD! more"])
    assert hit and outs == ["Hel", "lo ", ""]


def test_held_prefix_that_does_not_complete_is_released():
    m = StopStringMatcher(["\n\nUser:"])
    assert m.push("a\n") == ("a", False) and m.held == "\n"
    assert m.push("\nUs") == ("", False) and m.held == "\n\nUs"
    assert m.push("ually") == ("\n\nUsually", False) and m.held == ""


def test_held_text_is_released_at_the_end():
    assert _match(["</s>"], ["done</"]) == (["done", "</"], False)


def test_stop_at_the_very_start():
    assert _match(["STOP"], ["ST", "OP and more"]) == (["", ""], True)


def test_multiple_stop_strings_earliest_wins():
    assert _match(["world", "lo"], ["hello world"]) == (["hel"], True)
    assert _match(["abc", "bd"], ["ab", "d"]) == (["", "a"], True)


def test_chunking_never_changes_the_output():
    rng = np.random.default_rng(0)
    stops = ["ab", "bab", "cc", "abcab"]
    for _ in range(500):
        text = "".join(rng.choice(list("abcx"), size=rng.integers(1, 25)))
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        want = text[: min(hits)] if hits else text
        cuts = sorted(set(rng.integers(0, len(text) + 1, size=rng.integers(0, 6)).tolist()))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        outs, hit = _match(stops, chunks)
        assert "".join(outs) == want and hit == bool(hits)


# ---- token level --------------------------------------------------------------------------------


def _checker(tok, stop=(), max_tokens=100, ignore_eos=False):
    return StopChecker(Detokenizer(tok.token_bytes, skip_ids=tok.stop_token_ids), stop=stop,
                       stop_token_ids=tok.stop_token_ids, max_tokens=max_tokens, ignore_eos=ignore_eos)


def _push_all(checker, ids):
    out = []
    for i in ids:
        out.append(checker.push(i))
        if out[-1].finish_reason:
            break
    return out


def _joined(deliveries):
    return "".join(d.text for d in deliveries), [t for d in deliveries for t in d.token_ids]


def test_eos_finishes_with_stop_and_is_not_delivered():
    tok = FakeTokenizer()
    c = _checker(tok)
    ds = _push_all(c, [ord("h"), ord("i"), EOT, ord("x")])
    assert ds[-1].finish_reason == "stop" and _joined(ds) == ("hi", [ord("h"), ord("i")])
    assert (c.generated, c.delivered) == (3, 2)


def test_ignore_eos_delivers_it_without_text():
    tok = FakeTokenizer()
    c = _checker(tok, ignore_eos=True, max_tokens=3)
    ds = _push_all(c, [ord("h"), EOS, ord("i")])
    assert ds[-1].finish_reason == "length" and _joined(ds) == ("hi", [ord("h"), EOS, ord("i")])


def test_max_tokens_is_length_with_exact_count_and_held_text_flushed():
    tok = FakeTokenizer()
    c = _checker(tok, stop=["\n\n"], max_tokens=3)
    ds = _push_all(c, [ord("a"), ord("b"), ord("\n")])
    assert [d.text for d in ds] == ["a", "b", "\n"]
    assert ds[-1].finish_reason == "length" and c.delivered == 3 == len(_joined(ds)[1])


def test_stop_completing_in_the_token_that_reaches_max_tokens_is_stop():
    tok = FakeTokenizer(extra=[b"XY"])
    c = _checker(tok, stop=["X"], max_tokens=3)
    ds = _push_all(c, [ord("a"), ord("b"), tok.id_of("XY")])
    assert ds[-1].finish_reason == "stop" and _joined(ds) == ("ab", [ord("a"), ord("b")])


def test_token_running_into_the_stop_string_is_delivered():
    tok = FakeTokenizer(extra=[b"x\n", b"\nUs", b"er:", b"ok"])
    c = _checker(tok, stop=["\nUser:"])
    ids = [tok.id_of("ok"), tok.id_of("x\n"), ord("U"), ord("s"), tok.id_of("er:")]
    ds = _push_all(c, ids)
    assert ds[-1].finish_reason == "stop"
    assert _joined(ds) == ("okx", ids[:2]) and c.delivered == 2
    # The same stop starting on a token boundary: the tokens inside it are not delivered.
    c = _checker(tok, stop=["\nUser:"])
    ids = [tok.id_of("ok"), tok.id_of("\nUs"), tok.id_of("er:")]
    ds = _push_all(c, ids)
    assert _joined(ds) == ("ok", ids[:1]) and c.delivered == 1


def test_stop_at_the_start_delivers_nothing():
    tok = FakeTokenizer(extra=[b"END", b"ok"])
    c = _checker(tok, stop=["END"])
    ds = _push_all(c, [tok.id_of("END"), tok.id_of("ok")])
    assert len(ds) == 1 and ds[0].finish_reason == "stop" and _joined(ds) == ("", []) and c.delivered == 0


def test_held_tokens_are_delivered_with_their_text_when_the_prefix_breaks():
    tok = FakeTokenizer()
    c = _checker(tok, stop=["\n\nUser:"])
    ds = _push_all(c, [ord(ch) for ch in "a\n\nUs!"])
    assert [d.text for d in ds] == ["a", "", "", "", "", "\n\nUs!"]
    assert [len(d.token_ids) for d in ds] == [1, 0, 0, 0, 0, 5]


def test_partial_character_tokens_go_with_the_token_completing_them():
    emoji = "😀".encode()
    tok = FakeTokenizer(extra=[emoji[:2], emoji[2:] + b"!"])
    c = _checker(tok, stop=["!"])
    ids = [tok.id_of(emoji[:2]), tok.id_of(emoji[2:] + b"!")]
    ds = _push_all(c, ids)
    assert _joined(ds) == ("😀", ids) and ds[-1].finish_reason == "stop"
    # A stop that starts with the emoji: neither half is delivered.
    c = _checker(tok, stop=["😀"])
    ds = _push_all(c, [ord("a")] + ids)
    assert _joined(ds) == ("a", [ord("a")]) and c.delivered == 1


EMOJI = "😀".encode()  # 4 bytes


def test_a_length_cut_inside_a_character_ends_at_the_last_whole_one_and_delivers_every_token():
    """The cut character's first bytes stay out of the text; the tokens holding them were
    generated, so they are delivered and counted."""
    tok = FakeTokenizer(extra=[EMOJI[:2], EMOJI[2:3], b"b" + EMOJI[:2]])
    half = tok.id_of(EMOJI[:2])
    c = _checker(tok, max_tokens=1)
    ds = _push_all(c, [half])
    assert _joined(ds) == ("", [half]) and (c.generated, c.delivered) == (1, 1)
    assert ds[-1].finish_reason == "length"
    c = _checker(tok, max_tokens=2)
    ds = _push_all(c, [ord("a"), half])
    assert _joined(ds) == ("a", [ord("a"), half]) and (c.generated, c.delivered) == (2, 2)
    # Two tokens of the same unfinished character: both are delivered.
    c = _checker(tok, max_tokens=3)
    ids = [ord("a"), half, tok.id_of(EMOJI[2:3])]
    assert _joined(_push_all(c, ids)) == ("a", ids) and c.delivered == 3
    # A token with a whole character before the cut one is delivered, without the cut bytes.
    c = _checker(tok, max_tokens=2)
    assert _joined(_push_all(c, [ord("a"), tok.id_of(b"b" + EMOJI[:2])])) == ("ab", [ord("a"), tok.id_of(b"b" + EMOJI[:2])])


@pytest.mark.parametrize("pieces, stop, max_tokens, text, past, delivered", [
    # A stop string that begins inside a token: that token is delivered, its text runs into the stop string.
    (["A", " dog", " is", " a", " loyal", " friend"], ["loyal"], 100, "A dog is a ", b"loyal", 5),
    # A length cut inside a character: the token holding its first bytes is delivered.
    (["A", " dog", EMOJI[:2]], [], 3, "A dog", EMOJI[:2], 3),
    # A stop string that begins at a token's start: that token is not delivered, nothing runs past.
    (["A", " dog", " is", " loyal"], [" loyal"], 100, "A dog is", b"", 3),
])
def test_the_delivered_tokens_are_the_text_and_run_past_it_only_in_a_token_a_cut_reaches_into(
        pieces, stop, max_tokens, text, past, delivered):
    """The rule stop.py states for the text, the delivered tokens (one logprob entry each) and
    completion_tokens: the tokens up to the last one any of whose bytes the text holds, whose
    bytes joined are the text's and then ``past``, the rest of the token a cut reaches into."""
    tok = FakeTokenizer(extra=[p if isinstance(p, bytes) else p.encode() for p in pieces if len(p) > 1])
    ids = [tok.id_of(p) for p in pieces]
    c = _checker(tok, stop=stop, max_tokens=max_tokens)
    got, tokens = _joined(_push_all(c, ids))
    assert got == text
    assert tokens == ids[:delivered] and c.delivered == delivered
    assert b"".join(tok.token_bytes(t) for t in tokens) == text.encode() + past


def test_a_stop_token_after_an_unfinished_character_leaves_a_replacement_character():
    tok = FakeTokenizer(extra=[EMOJI[:2]])
    c = _checker(tok, max_tokens=5)
    ds = _push_all(c, [ord("a"), tok.id_of(EMOJI[:2]), EOS])
    assert _joined(ds) == ("a\ufffd", [ord("a"), tok.id_of(EMOJI[:2])]) and ds[-1].finish_reason == "stop"


@pytest.mark.parametrize("seed", range(20))
def test_streamed_count_equals_the_rule_on_the_final_text(seed):
    """Random tokens over a tiny alphabet: the deliveries' tokens are exactly the generated ones
    up to the token completing the last delivered character."""
    rng = np.random.default_rng(seed)
    pieces = [b"a", b"b", b"ab", b"ba", b"\n", b"a\n", b"\nb"]
    tok = FakeTokenizer(extra=[p for p in pieces if len(p) > 1])
    ids = [tok.id_of(pieces[i]) for i in rng.integers(len(pieces), size=20)]
    c = _checker(tok, stop=["\nba", "bb\n"], max_tokens=20)
    ds = _push_all(c, ids)
    text, delivered = _joined(ds)
    ends = np.cumsum([len(tok.token_bytes(i)) for i in ids])            # one char per byte here
    want = 0 if not text else int(np.searchsorted(ends, len(text))) + 1
    assert delivered == ids[:want] and c.delivered == want
