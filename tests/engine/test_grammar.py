"""The llguidance bridge and ``GrammarProcessor`` on their own (no engine, no picker): the mask on
a tiny fake vocabulary, compile errors, and a constrained greedy loop over the real SmolLM2
vocabulary whose output parses and validates."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from engine_fakes import EOS, EOT, FakeTokenizer

from flm_runtime.errors import InvalidRequestError
from flm_runtime.sampling.grammar import (GrammarCompiler, compiler_for, json_object_grammar, json_schema_grammar,
                                        lark_grammar)

OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


tok = FakeTokenizer(vocab_size=300)


@pytest.fixture(scope="module")
def fake_compiler() -> GrammarCompiler:
    return GrammarCompiler(tok)


def allowed_ids(processor, vocab: int = 300) -> list[int]:
    """The ids ``process`` leaves finite on a row of zeros."""
    return np.flatnonzero(np.isfinite(processor.process(np.zeros(vocab, dtype=np.float32)))).tolist()


def test_mask_on_tiny_logits_follows_the_schema_token_by_token(fake_compiler):
    proc = fake_compiler.processor(json_schema_grammar(OK_SCHEMA))
    logits = np.full(300, -1.0, dtype=np.float32)
    logits[ord("x")] = 5.0                                 # the model's favourite is not JSON
    logits[ord("{")] = 1.0
    out = proc.process(logits)
    assert out is logits and int(np.argmax(out)) == ord("{")
    assert np.flatnonzero(np.isfinite(out)).tolist() == [ord("{")]
    # Before each character of the answer, what may come: any token that keeps it valid, as
    # " f" (the start of " false") beside " " after the colon.
    steps = [('"', [b'"']), ("o", [b"o"]), ("k", [b"k"]), ('"', [b'"']), (":", [b":"]), (" ", [b" ", b" f"]),
             ("t", [b"f", b"t"]), ("r", [b"r"]), ("u", [b"u"]), ("e", [b"e"]), ("}", [b"}"])]
    proc.accept(ord("{"))
    for char, allowed in steps:
        assert [tok.vocab[i] for i in allowed_ids(proc)] == allowed, char
        proc.accept(ord(char))
    assert allowed_ids(proc) == sorted([EOS, EOT])       # complete: only the stop tokens


def test_json_object_mode_allows_any_object_and_nothing_else(fake_compiler):
    proc = fake_compiler.processor(json_object_grammar())
    assert allowed_ids(proc) == [ord("{")]
    for char in '{"a": [1, {}], "b": null}':
        assert ord(char) in allowed_ids(proc), char
        proc.accept(ord(char))
    assert allowed_ids(proc) == sorted([EOS, EOT])


def test_logits_longer_than_the_vocabulary_are_masked_past_it(fake_compiler):
    proc = fake_compiler.processor(json_object_grammar())
    out = proc.process(np.zeros(320, dtype=np.float32))       # a model padded 20 ids past the tokenizer
    assert np.flatnonzero(np.isfinite(out)).tolist() == [ord("{")]


def test_a_forbidden_token_fails_the_processor(fake_compiler):
    proc = fake_compiler.processor(json_schema_grammar(OK_SCHEMA))
    with pytest.raises(RuntimeError, match="constrained decoding failed"):
        proc.accept(ord("x"))


@pytest.mark.parametrize("schema, reason", [
    ({"type": "strin"}, "strin"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
])
def test_a_schema_that_cannot_compile_is_an_invalid_request_naming_why(fake_compiler, schema, reason):
    with pytest.raises(InvalidRequestError, match=reason) as info:
        fake_compiler.processor(json_schema_grammar(schema))
    assert info.value.param == "response_format"
    assert "cannot be compiled" in str(info.value)


def test_a_schema_that_is_not_an_object_is_refused():
    with pytest.raises(InvalidRequestError, match="must be an object, got list") as info:
        json_schema_grammar([{"type": "object"}], param="response_format.json_schema.schema")
    assert info.value.param == "response_format.json_schema.schema"


def test_lark_grammar_with_an_inline_schema(fake_compiler):
    proc = fake_compiler.processor(lark_grammar('start: "A" %json {"type": "integer", "minimum": 0, "maximum": 9}'),
                                   param="tools")
    assert allowed_ids(proc) == [ord("A")]
    proc.accept(ord("A"))
    assert allowed_ids(proc) == [ord(c) for c in "0123456789"]
    proc.accept(ord("7"))
    assert allowed_ids(proc) == sorted([EOS, EOT])


NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "vip": {"type": "boolean"}},
                  "required": ["city", "vip"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(5))
def test_greedy_over_random_logits_on_the_smollm2_vocabulary_gives_valid_json(smollm2_tokenizer, seed):
    """Random logits stand in for a model: whatever it prefers, the masked argmax spells JSON that
    validates, in whatever tokens, and ends on a stop token once the object is complete."""
    tok = smollm2_tokenizer
    proc = compiler_for(tok).processor(json_schema_grammar(NESTED_SCHEMA))
    rng = np.random.default_rng(seed)
    tokens = []
    for _ in range(400):
        token = int(np.argmax(proc.process(rng.standard_normal(tok.vocab_size).astype(np.float32))))
        proc.accept(token)
        if token in tok.stop_token_ids:
            break
        tokens.append(token)
    else:
        pytest.fail(f"no stop token in 400 steps: {tok.decode(tokens)!r}")
    value = json.loads(tok.decode(tokens))
    jsonschema.validate(value, NESTED_SCHEMA)


def test_one_compiler_per_tokenizer(smollm2_tokenizer):
    assert compiler_for(smollm2_tokenizer) is compiler_for(smollm2_tokenizer)


NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
               "additionalProperties": False}


def ids_of(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_speculate_cuts_a_proposal_at_the_first_forbidden_token_and_puts_in_the_forced_ones(fake_compiler):
    """From the start the schema forces '{"name": "' (10 one-byte tokens): a proposal that agrees
    with it is taken as forced, one that leaves it is dropped from there (its later tokens follow a
    token the grammar forbids), and ``most`` cuts the forced run. Inside the string nothing is
    forced: the proposal's tokens are taken while allowed, then the grammar forces '}' (which the
    proposal agrees with), then EOS is allowed and nothing after it. The matcher is left as it was."""
    proc = fake_compiler.processor(json_schema_grammar(NAME_SCHEMA))
    opening = ids_of('{"name": "')

    def check(proposal, most, want_ids, want_forced):
        before = allowed_ids(proc)
        ids, forced = proc.speculate(np.array(proposal, dtype=np.int64), most)
        assert (ids.dtype, forced.dtype) == (np.int64, bool)
        assert (ids.tolist(), forced.tolist()) == (want_ids, want_forced)
        assert allowed_ids(proc) == before

    check([], 7, opening[:7], [True] * 7)
    check(opening[:3], 12, opening, [True] * 10)
    check(ids_of('{"nXme": "A'), 12, opening, [True] * 10)
    for token in opening:
        proc.accept(token)
    check(ids_of('Ada"}') + [EOS, ord("x")], 12, ids_of('Ada"}') + [EOS], [False] * 4 + [True, False])
    check(ids_of('Ada"]') + [EOS], 12, ids_of('Ada"}'), [False] * 4 + [True])   # ']' forbidden: '}' forced
    check(ids_of("A\x01da"), 12, ids_of("A"), [False])                           # a control byte: forbidden
    check(ids_of("Ad") + [300, 5000], 12, ids_of("Ad"), [False, False])          # ids past the vocabulary too
    check(ids_of('Ada"}'), 3, ids_of("Ada"), [False] * 3)
    proc.accept(ord("A"))                                                        # it follows emitted tokens still
    check(ids_of('da"}'), 12, ids_of('da"}'), [False] * 3 + [True])
