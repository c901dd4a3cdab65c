"""Speculative decoding on the embedded SmolLM2-135M with random DFlash drafts (the trained draft
does not exist in the test suite): greedy output equals the baseline token for token, through
``get_engine`` of a DFlash tag (sharing the base tag's model object) and with a proposer that
replays the baseline with corrupted positions (long acceptances and rollbacks).

Comparison rule (docs/design.md, "Contract", 1): the outputs must agree except where the baseline's
top-1/top-2 logit margin is below ``MARGIN_TOL``: the verify pass and a decode step differ by float
rounding (~1e-3 on a logit, tests/models/test_llama.py), which may flip a near-tie. Such positions
are counted and reported (``record_property`` "near_ties"); comparison of that prompt stops there.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from spec_fakes import draft_config_dict, random_draft_weights, replay_proposer, spec_generate, write_draft_dir

from flm_runtime import api, registry
from flm_runtime.speculation import decoders
from flm_runtime.backends import decode, prefill
from flm_runtime.errors import ModelFormatError
from flm_runtime.request import SamplingParams
from flm_runtime.settings import SUFFIX_CACHE_TOKENS
from flm_runtime.speculation.policy import Bucket, PolicyTable
from flm_runtime.speculation.speculative import SpeculativeDecoder

MARGIN_TOL = 5e-3  # logits; 2.5x the per-logit tolerance between the verify and decode paths
N_TOKENS = 24
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
DFLASH_TAG = "smollm2-testdraft-dflash:135m"


def baseline(model, prompt, n):
    """Greedy tokens and the top-1/top-2 logit margin at each, from plain prefill + decode."""
    cache = model.new_cache(len(prompt) + n)
    logits = prefill(model, np.asarray(prompt, dtype=np.int64), cache).logits
    tokens, margins = [], []
    for _ in range(n):
        top2 = np.partition(logits, -2)[-2:]
        tokens.append(int(np.argmax(logits)))
        margins.append(float(top2[1] - top2[0]))
        logits = decode(model, tokens[-1], cache).logits
    return tokens, margins


def compare(got, want, margins) -> int:
    """Assert agreement up to the first near-tie; returns 1 if one cut the comparison, else 0."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert margins[i] < MARGIN_TOL, f"token {i}: {g} != {w} with a baseline margin of {margins[i]:.4f}"
            return 1
    assert len(got) == len(want)
    return 0


@pytest.fixture(scope="module")
def chats(smollm2_tokenizer, smollm2_model):
    tok = smollm2_tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True))
               for c in CHATS]
    return [(p, *baseline(smollm2_model, p, N_TOKENS)) for p in prompts]


def smollm2_draft_dir(path, model, sha256):
    cfg = draft_config_dict(model.config, layers=1, mask_token_id=0, target_tag="smollm2:135m", target_sha256=sha256)
    return write_draft_dir(path, cfg, random_draft_weights(cfg, seed=3, scale=0.05))


@pytest.fixture
def dflash_tag(tmp_path, monkeypatch, smollm2_model):
    """A DFlash tag over smollm2:135m with a random draft, through a user models file."""
    sha = registry.resolve("smollm2:135m").files[0].sha256

    def define(draft_sha=sha):
        draft = smollm2_draft_dir(tmp_path / "draft", smollm2_model, draft_sha)
        models = tmp_path / "models.yaml"
        models.write_text(yaml.safe_dump({DFLASH_TAG: {"base": "smollm2:135m", "draft": str(draft)}}))
        monkeypatch.setenv("FLM_MODELS_FILE", str(models))
        registry.reload()
        return DFLASH_TAG

    yield define
    api.default_runtime.forget(DFLASH_TAG)


def test_dflash_engine_shares_the_target_and_equals_greedy_baseline(dflash_tag, smollm2_engine, chats,
                                                                    record_property):
    engine = api.get_engine(dflash_tag())
    assert engine.model is smollm2_engine.model  # one copy of the target's weights per process
    assert engine.speculative.draft.embed is engine.model.embed
    near_ties = 0
    for prompt, want, margins in chats:
        done = engine.submit(prompt, SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)).result()
        near_ties += compare(list(done.token_ids), want, margins)
        s = done.stats
        assert s.spec.steps >= 1 and s.spec.drafted == 7 * s.spec.steps
        assert 1.0 <= s.spec.acceptance_length <= 8.0
    record_property("near_ties", near_ties)
    print(f"greedy equivalence, random draft: {near_ties} near-tie cut(s) in {len(chats)} prompts")


def test_a_repeated_request_takes_the_suffix_proposers_tokens(dflash_tag, chats, record_property):
    """Through ``get_engine`` of a DFlash tag, whose suffix proposer is on by default: the same
    chat twice. The first request's answer (after its prompt's end) joins the engine's index when
    it finishes; the second's greedy output is the baseline's, and the suffix proposer's steps (its proposals
    confident at the prior rate 0.5 against the random draft's ~0) were verified and kept more
    than one token each."""
    engine = api.get_engine(dflash_tag())
    assert engine.speculative.suffix.max_tokens == SUFFIX_CACHE_TOKENS
    prompt, want, margins = chats[0]
    params = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
    first = engine.submit(prompt, params).result()
    assert engine.idle(timeout=60)  # the index takes a finished request after its caller was told
    index = engine.speculative.suffix
    assert index.tokens == min(len(prompt), index.depth - 1) + N_TOKENS  # the answer after its prompt's end
    second = engine.submit(prompt, params).result()
    near_ties = sum(compare(list(done.token_ids), want, margins) for done in (first, second))
    assert first.stats.spec.counts("suffix").steps == 0
    suffix = second.stats.spec.counts("suffix")
    assert suffix.accepted > 0 and suffix.acceptance_length > 2.0, second.stats.spec
    figures = f"suffix {suffix.steps} steps, AL {suffix.acceptance_length:.2f}; {near_ties} near-tie cut(s)"
    record_property("repeated", figures)
    print(f"a repeated request: {figures}")


def test_flm_suffix_cache_tokens_0_turns_the_suffix_proposer_off(dflash_tag, monkeypatch):
    monkeypatch.setenv("FLM_SUFFIX_CACHE_TOKENS", "0")
    engine = api.get_engine(dflash_tag())
    assert engine.speculative.suffix is None
    assert [p.name for p in engine.speculative.new_state().proposers] == ["ngram"]


def test_dflash_engine_seeded_sampling_is_reproducible_and_equals_plain(dflash_tag, smollm2_engine, chats):
    """One draw per emitted token in both paths: the same seed gives the same tokens."""
    engine = api.get_engine(dflash_tag())
    prompt = chats[1][0]
    params = engine.sampling_params(temperature=0.8, top_p=0.9, seed=2024, max_tokens=16, ignore_eos=True)
    first, second = (engine.submit(prompt, params).result() for _ in range(2))
    assert first.token_ids == second.token_ids
    assert first.token_ids == smollm2_engine.submit(prompt, params).result().token_ids


def test_dflash_tag_refuses_a_draft_for_another_target_file(dflash_tag):
    with pytest.raises(ModelFormatError, match="sha256"):
        api.get_engine(dflash_tag(draft_sha="0" * 64))


def test_replaying_proposer_accepts_blocks_and_stays_exact(smollm2_model, chats, tmp_path, record_property):
    """Drafts of baseline tokens with every fourth position corrupted: multi-token acceptances and
    rollbacks of the target KV cache, still the baseline's output."""
    from flm_runtime.models.dflash import DFlashDraft

    draft = DFlashDraft.load(smollm2_draft_dir(tmp_path / "d", smollm2_model, None), smollm2_model)
    near_ties, steps, emitted = 0, 0, 0
    for prompt, want, margins in chats:
        truth = dict(enumerate(want, start=len(prompt)))
        proposer = replay_proposer(lambda p, truth=truth: truth.get(p, 0), smollm2_model.config.vocab_size,
                                   corrupt=lambda p: p % 4 == 0)
        decoder = SpeculativeDecoder(smollm2_model, draft, proposer=proposer)
        got, _, state = spec_generate(decoder, prompt, N_TOKENS, SamplingParams())
        near_ties += compare(got, want, margins)
        steps, emitted = steps + state.stats.steps, emitted + state.stats.emitted
    assert emitted / steps > 2.5, emitted / steps  # AL, bonus included
    record_property("near_ties", near_ties)
    print(f"greedy equivalence, replaying proposer: AL {emitted / steps:.2f}, {near_ties} near-tie cut(s)")


def test_eight_batched_speculative_requests_equal_each_alone(make_engine, smollm2_model, smollm2_tokenizer,
                                                             chats, monkeypatch):
    """Isolation (docs/design.md, "Contract", 6) with speculative decoding: 8 concurrent requests
    (mixed prompts and budgets, greedy beside sampled with other seeds) through the shipped draft
    give the tokens each gives alone, and their verify rows did share target passes (8 lanes drafted
    together and verified in one ``forward_batch``)."""
    decoder = SpeculativeDecoder(smollm2_model, decoders.load_draft("smollm2-dflash:135m", smollm2_model))
    engine = make_engine(smollm2_model, smollm2_tokenizer, speculative=decoder)
    prompts = [p for p, _, _ in chats] + [smollm2_tokenizer.encode(t) for t in
                                          ("Once upon a time,", "def add(a, b):", "1, 2, 3,", "Dear team,", "The weather today")]
    params = [SamplingParams(max_tokens=8 + 3 * (i % 3), ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=1.0, top_k=64, top_p=0.95, seed=20 + i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    alone = [engine.submit(p, q).result().token_ids for p, q in zip(prompts, params)]

    lanes = []
    prepare = decoder.prepare
    monkeypatch.setattr(decoder, "prepare", lambda ls: lanes.append(len(ls)) or prepare(ls))
    with engine.held():  # hold the engine thread back until all 8 are queued
        handles = [engine.submit(p, q) for p, q in zip(prompts, params)]
    together = [h.result() for h in handles]
    assert lanes[0] == 8, lanes
    assert [d.token_ids for d in together] == alone
    assert [d.completion_tokens for d in together] == [q.max_tokens for q in params]
    assert all(d.stats.spec.steps >= 1 for d in together)


def test_penalties_bias_and_logprobs_speculative_and_batched_equal_plain(make_engine, smollm2_engine, smollm2_model,
                                                                         smollm2_tokenizer, chats):
    """The shipped draft verifying whole blocks at every step (``ALWAYS_SPECULATE``), requests with
    penalties, a logit bias and logprobs, greedy and seeded-sampled, run together: each gives the
    tokens and logprobs (within 1e-4) that plain decoding gives it alone."""
    decoder = SpeculativeDecoder(smollm2_model, decoders.load_draft("smollm2-dflash:135m", smollm2_model))
    engine = make_engine(smollm2_model, smollm2_tokenizer, speculative=decoder)
    shared = dict(logprobs=True, top_logprobs=5, max_tokens=16, ignore_eos=True)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, logit_bias={28: 3.0}, **shared),
              SamplingParams(temperature=0.8, top_p=0.95, seed=5, repetition_penalty=1.3, **shared),
              SamplingParams(temperature=1.0, top_k=64, seed=9, frequency_penalty=-0.5, logit_bias={314: -100.0},
                             **shared)]
    prompts = [p for p, _, _ in chats]
    plain = [smollm2_engine.submit(p, q).result() for p, q in zip(prompts, params)]
    with engine.held():  # all queued before the first step
        handles = [engine.submit(p, q) for p, q in zip(prompts, params)]
    for handle, want in zip(handles, plain):
        got = handle.result()
        assert got.token_ids == want.token_ids and len(got.logprobs) == got.completion_tokens == 16
        assert [(r.token_id, [t for t, _ in r.top]) for r in got.logprobs] == \
            [(r.token_id, [t for t, _ in r.top]) for r in want.logprobs]
        np.testing.assert_allclose([[r.logprob, *(lp for _, lp in r.top)] for r in got.logprobs],
                                   [[r.logprob, *(lp for _, lp in r.top)] for r in want.logprobs], atol=1e-4)
        assert got.stats.spec.steps >= 1 and got.stats.spec.accepted >= 1


COPY = ("Repeat the following paragraph exactly, word for word:\n\n"
        "The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper climbed "
        "the spiral stairs, trimmed the wick and watched the ships pass safely through the narrow channel below.")


def test_prompt_lookup_on_a_copying_prompt_equals_plain(make_engine, smollm2_engine, smollm2_model, smollm2_tokenizer,
                                                        record_property):
    """The shipped draft with and without prompt lookup on a prompt that asks for a paragraph back:
    greedy and seeded-sampled, each gives plain decoding's tokens; with prompt lookup the n-gram
    proposer's steps were verified and kept more than one token each."""
    tok = smollm2_tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY}], add_generation_prompt=True))
    draft = decoders.load_draft("smollm2-dflash:135m", smollm2_model)
    params = [SamplingParams(max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=48, ignore_eos=True)]
    for p in params:
        want = smollm2_engine.submit(prompt, p).result().token_ids
        stats = {}
        for ngram in (True, False):
            engine = make_engine(smollm2_model, tok, speculative=SpeculativeDecoder(smollm2_model, draft, ngram=ngram))
            done = engine.submit(prompt, p).result()
            assert done.token_ids == want
            stats[ngram] = done.stats.spec
        ngram = stats[True].counts("ngram")
        assert stats[False].counts("ngram").steps == 0 and ngram.steps >= 1
        assert ngram.acceptance_length > 1.0
        figures = (f"AL {stats[True].acceptance_length:.2f} (n-gram {ngram.steps} steps, AL "
                   f"{ngram.acceptance_length:.2f}) vs draft alone {stats[False].acceptance_length:.2f}")
        record_property("greedy" if p.greedy else "sampled", figures)
        print(f"copying prompt, {'greedy' if p.greedy else 'sampled'}: {figures}")


def test_ngram_only_steps_on_a_copying_prompt_equal_plain(make_engine, smollm2_engine, smollm2_model,
                                                         smollm2_tokenizer, record_property):
    """A table that speculates nowhere, as the shipped cpu table: with verify ratios, n-gram-only
    steps copy the paragraph back (the draft never runs) and the output is plain decoding's, greedy
    and seeded-sampled; without them (a table calibrated before they were recorded) every step is
    plain."""
    tok = smollm2_tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": COPY}], add_generation_prompt=True))
    draft = decoders.load_draft("smollm2-dflash:135m", smollm2_model)
    asked = []
    draft.draft_blocks = lambda *a, **kw: asked.append(a)  # (a request whose draft ran would fail)
    params = [SamplingParams(max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=48, ignore_eos=True)]
    for p in params:
        want = smollm2_engine.submit(prompt, p).result().token_ids
        for ratio in ([1.2, 1.5, 1.7, 2.0, 2.4, 2.8, 3.0], None):
            table = PolicyTable(model="smollm2-dflash:135m", backend="cpu", block_size=8, buckets=[
                Bucket(max_context=8192, speculate=False, verify_ratio=ratio)])
            engine = make_engine(smollm2_model, tok, speculative=SpeculativeDecoder(smollm2_model, draft, policy=table))
            done = engine.submit(prompt, p).result()
            assert done.token_ids == want
            s, ngram = done.stats.spec, done.stats.spec.counts("ngram")
            if ratio is None:
                assert (s.steps, ngram.steps, s.gated) == (0, 0, 0)
            else:
                assert ngram.steps == s.steps >= 1 and ngram.acceptance_length > 1.0, s
                figures = f"{ngram.steps} n-gram-only steps, AL {ngram.acceptance_length:.2f}"
                record_property("greedy" if p.greedy else "sampled", figures)
                print(f"copying prompt, no speculation, {'greedy' if p.greedy else 'sampled'}: {figures}")
    assert asked == []
