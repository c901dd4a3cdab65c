"""Constrained decoding in the engine on SmolLM2-135M (default quantized weights, so rows are
bit-identical alone, batched or in a verify pass: docs/design.md, "Batch invariance"): the output
validates, and speculation forced on (``ALWAYS_SPECULATE``, the shipped draft) gives exactly the
tokens of plain decoding, alone and batched, greedy and seeded."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import numpy as np
import pytest

from flm_runtime.speculation import decoders
from flm_runtime.request import SamplingParams
from flm_runtime.sampling.grammar import compiler_for, json_object_grammar, json_schema_grammar, lark_grammar
from flm_runtime.speculation.speculative import SpeculativeDecoder
from flm_runtime.text import tool_format

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["engineer", "doctor", "teacher"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
}, "required": ["name", "age", "role", "skills", "address"], "additionalProperties": False}
CASES = [
    ("Describe a software engineer called Ada as JSON.", PERSON),
    ("Give the capital of France as JSON.", {"type": "object", "properties": {"capital": {"type": "string",
                                                                                        "maxLength": 30}},
                                             "required": ["capital"], "additionalProperties": False}),
    ('Give me a JSON object describing a cat, with keys "name" and "color".', None),  # JSON mode: any object
    ("What is the weather in Paris?", "tools"),  # a required call of get_weather (tool_format)
]
WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def engines(smollm2_quantized, smollm2_tokenizer):
    from flm_runtime.scheduling.engine import Engine

    decoder = SpeculativeDecoder(smollm2_quantized, decoders.load_draft("smollm2-dflash:135m", smollm2_quantized))
    plain = Engine(smollm2_quantized, smollm2_tokenizer, name="grammar-plain")
    spec = Engine(smollm2_quantized, smollm2_tokenizer, name="grammar-spec", speculative=decoder)
    yield plain, spec
    plain.close()
    spec.close()


@pytest.fixture(scope="module")
def greedy_plain(engines, smollm2_tokenizer):
    """The plain engine's greedy answer to each of ``CASES``, shared by the tests that compare with it."""
    plain, _ = engines
    return [submit(plain, smollm2_tokenizer, q, s, SamplingParams(max_tokens=MAX_TOKENS)).result() for q, s in CASES]


def prompt_ids(tok, question, schema):
    messages = [{"role": "user", "content": question}]
    if schema == "tools":
        messages = tool_format.render_messages(messages, [WEATHER])
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def grammar_of(schema):
    if schema == "tools":
        return lark_grammar(tool_format.tool_grammar([WEATHER], "required", parallel=True))
    return json_object_grammar() if schema is None else json_schema_grammar(schema)


def submit(engine, tok, question, schema, params):
    return engine.submit(prompt_ids(tok, question, schema), params,
                         processors=[compiler_for(tok).processor(grammar_of(schema))])


def check_valid(done, schema):
    assert done.finish_reason == "stop", done.text
    if schema == "tools":
        content, calls = tool_format.parse_tool_calls(done.text)
        assert content is None and calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        return
    jsonschema.validate(json.loads(done.text), schema or {"type": "object"})


def test_greedy_constrained_output_is_valid_and_speculation_changes_no_token(engines, greedy_plain,
                                                                                smollm2_tokenizer):
    _, spec = engines
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for (question, schema), want in zip(CASES, greedy_plain):
        got = submit(spec, smollm2_tokenizer, question, schema, params).result()
        check_valid(want, schema)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.stats.spec.steps >= 1 and got.stats.spec.accepted >= 1


def test_constrained_requests_batched_with_speculation_equal_each_alone(engines, greedy_plain, smollm2_tokenizer):
    plain, spec = engines
    params = [SamplingParams(max_tokens=MAX_TOKENS), SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=MAX_TOKENS),
              SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS)]
    alone = greedy_plain[:1] + [submit(plain, smollm2_tokenizer, q, s, p).result()
                                for (q, s), p in zip(CASES[1:], params[1:])]
    with spec.held():  # hold the engine thread back until all are queued: they run as one batch
        handles = [submit(spec, smollm2_tokenizer, q, s, p) for (q, s), p in zip(CASES, params)]
    together = [h.result() for h in handles]
    assert [d.token_ids for d in together] == [d.token_ids for d in alone]
    for done, (_, schema) in zip(alone, CASES):
        check_valid(done, schema)


def test_drafted_tokens_the_grammar_forbids_are_cut_from_the_proposals(smollm2_quantized, smollm2_tokenizer, engines,
                                                                        greedy_plain):
    """A proposer that drafts the plain answer's own tokens, but ``<|im_start|>`` (which no grammar
    allows) at every third position, and a ``logit_bias`` of +100 that makes that token the
    target's favourite everywhere: only the mask stands between it and acceptance. Each proposal
    is cut before it (the forced tokens in its place), so every verified token is kept, blocks
    are long, and the answer is still exactly the plain one."""
    from flm_runtime.scheduling.engine import Engine

    plain, _ = engines
    tok, forbidden = smollm2_tokenizer, smollm2_tokenizer.token_to_id("<|im_start|>")
    question, schema = CASES[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, logit_bias={forbidden: 100.0})
    want = submit(plain, tok, question, schema, params).result()
    assert want.token_ids == greedy_plain[0].token_ids
    truth = dict(enumerate(want.token_ids, start=len(prompt_ids(tok, question, schema))))

    def proposer(draft_cache, anchor_id, start):
        return np.array([forbidden if p % 3 == 0 else truth.get(p, forbidden) for p in range(start + 1, start + 8)])

    decoder = SpeculativeDecoder(smollm2_quantized, decoders.load_draft("smollm2-dflash:135m", smollm2_quantized),
                                 proposer=proposer)
    engine = Engine(smollm2_quantized, tok, name="grammar-forbidden", speculative=decoder)
    try:
        got = submit(engine, tok, question, schema, params).result()
    finally:
        engine.close()
    assert got.token_ids == want.token_ids
    spec = got.stats.spec
    assert spec.drafted == spec.accepted >= spec.steps and spec.acceptance_length > 2.0


CUSTOMER = {"type": "object", "properties": {
    "customer_full_name": {"type": "string", "maxLength": 20},
    "preferred_contact_method": {"enum": ["email", "telephone"]},
    "number_of_previous_orders": {"type": "integer", "minimum": 0, "maximum": 99},
    "customer_is_a_returning_customer": {"type": "boolean"}},
    "required": ["customer_full_name", "preferred_contact_method", "number_of_previous_orders",
                 "customer_is_a_returning_customer"], "additionalProperties": False}
CUSTOMER_QUESTION = "Describe a customer called Ada Lovelace as JSON."


def forced_runs(tok, token_ids) -> list[int]:
    """The steps of forced tokens alone that an engine taking no other speculative step runs on
    this output (one per anchor whose next tokens the grammar forces: up to 7 of them, then the
    target's own), replayed through a fresh llguidance matcher: the tokens each verifies."""
    matcher = llguidance.LLMatcher(compiler_for(tok).llg_tokenizer, json_schema_grammar(CUSTOMER))
    ids, runs, anchor = list(token_ids), [], 0  # the first token comes from the prompt's logits
    matcher.consume_token(ids[0])
    while anchor < len(ids) - 1:
        run = matcher.compute_ff_tokens()[:7]
        assert ids[anchor + 1 : anchor + 1 + len(run)] == run
        runs += [len(run)] if run else []
        step_end = min(anchor + len(run) + 1, len(ids) - 1)  # the bonus, or the last token before EOS
        assert matcher.consume_tokens(ids[anchor + 1 : step_end + 1])
        anchor = step_end
    return runs


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=MAX_TOKENS),
                                    SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS)],
                         ids=["greedy", "sampled"])
def test_forced_tokens_are_proposed_and_always_kept(engines, smollm2_quantized, smollm2_tokenizer, params):
    """A schema of long keys, whose every key and separator the grammar forces: with the draft at
    every step, and with no speculation but the forced tokens (a table that speculates nowhere at
    verify ratios of 1, no prompt lookup), the tokens are plain decoding's (greedy and seeded). The
    second engine's steps are exactly those a replay of the output through a fresh matcher finds,
    each keeping every forced token; in the first, every step of forced tokens alone keeps them all."""
    from flm_runtime.scheduling.engine import Engine
    from flm_runtime.speculation.policy import Bucket, PolicyTable

    plain, spec = engines
    tok = smollm2_tokenizer
    want = submit(plain, tok, CUSTOMER_QUESTION, CUSTOMER, params).result()
    check_valid(want, CUSTOMER)
    got = submit(spec, tok, CUSTOMER_QUESTION, CUSTOMER, params).result()
    assert got.token_ids == want.token_ids
    grammar = got.stats.spec.counts("grammar")
    assert got.stats.spec.forced >= 20 and grammar.accepted == grammar.drafted == grammar.forced, got.stats.spec

    table = PolicyTable(model="t", backend="cpu", block_size=8,
                        buckets=[Bucket(max_context=4096, speculate=False, verify_ratio=[1.0] * 7)])
    decoder = SpeculativeDecoder(smollm2_quantized, spec.speculative.draft, policy=table, ngram=False)
    engine = Engine(smollm2_quantized, tok, name="grammar-forced", speculative=decoder)
    try:
        forced = submit(engine, tok, CUSTOMER_QUESTION, CUSTOMER, params).result()
    finally:
        engine.close()
    assert forced.token_ids == want.token_ids
    runs = forced_runs(tok, want.token_ids)
    s = forced.stats.spec
    assert (s.steps, s.drafted, s.accepted, s.forced, s.forced_accepted) == (len(runs), *[sum(runs)] * 4)
    assert s.counts("grammar").steps == len(runs) >= 4
