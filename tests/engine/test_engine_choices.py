"""A request of ``n`` choices (``Engine.submit_choices``): one prefill, a KV copy per choice, one
seed stream per choice, the KV budget of ``n`` sequences, and each choice cancelled on its own."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from engine_fakes import FakeCache, HashModel
from test_engine_core import idle, wait_until

from flm_runtime.errors import InvalidRequestError, KVBudgetError
from flm_runtime.request import SamplingParams
from flm_runtime.sampling import sampler
from flm_runtime.scheduling.handle import RequestCancelledError

PROMPT = [5, 17, 200, 33, 9, 140, 71, 2, 250, 64]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=7, max_tokens=12)


def prompt_rows(model, prompt) -> int:
    """Rows of ``model``'s passes that fed ``prompt``'s tokens (prompt chunks are ``len(prompt)``
    rows at most; decode rows are single)."""
    return sum(rows for p in model.passes for rows, _ in p if rows > 1) + (len(prompt) == 1)


def results(handles):
    return [(done.token_ids, done.text, done.finish_reason) for done in (h.result() for h in handles)]


def test_greedy_choices_equal_one_choice_and_the_prompt_is_prefilled_once(make_engine, tok):
    model = HashModel()
    engine = make_engine(model, tok)
    alone = results([engine.submit(PROMPT, GREEDY)])
    model.passes.clear()
    handles = engine.submit_choices(PROMPT, GREEDY, 3)
    assert results(handles) == alone * 3
    assert prompt_rows(model, PROMPT) == len(PROMPT)
    # After the prompt's pass, every step decodes the three choices together.
    assert [len(p) for p in model.passes] == [1] + [3] * (GREEDY.max_tokens - 1)
    assert idle(engine)


def test_a_seeded_request_gives_the_same_choices_each_time_and_choice_i_is_its_derived_seed(make_engine, tok):
    engine = make_engine(HashModel(), tok)
    first, second = (results(engine.submit_choices(PROMPT, SAMPLED, 4)) for _ in range(2))
    assert first == second
    assert len({tokens for tokens, _, _ in first}) == 4  # sampled: the choices differ
    seeds = [sampler.choice_seed(SAMPLED.seed, i) for i in range(4)]
    alone = [results([engine.submit(PROMPT, dataclasses.replace(SAMPLED, seed=seed))])[0] for seed in seeds]
    assert first == alone
    assert sampler.choice_seed(SAMPLED.seed, 0) == SAMPLED.seed  # choice 0 is the one-choice request


def test_choice_seeds_of_neighbouring_seeds_do_not_meet():
    seeds = {sampler.choice_seed(s, i) for s in range(50) for i in range(8)}
    assert len(seeds) == 50 * 8 and sampler.choice_seed(None, 3) is None


def test_unseeded_choices_differ(make_engine, tok):
    engine = make_engine(HashModel(), tok)
    got = results(engine.submit_choices(PROMPT, dataclasses.replace(SAMPLED, seed=None), 3))
    assert len({tokens for tokens, _, _ in got}) == 3


class UncopyableModel(HashModel):
    """Caches without ``copy`` (as the npu backend's)."""

    def new_cache(self, capacity: int = 0, pool=None) -> FakeCache:
        cache = super().new_cache(capacity, pool)
        cache.copy = None
        return cache


def test_a_cache_that_cannot_be_copied_prefills_each_choice(make_engine, tok):
    copying, uncopyable = HashModel(), UncopyableModel()
    want = results(make_engine(copying, tok).submit_choices(PROMPT, SAMPLED, 3))
    engine = make_engine(uncopyable, tok)
    assert results(engine.submit_choices(PROMPT, SAMPLED, 3)) == want
    assert prompt_rows(uncopyable, PROMPT) == 3 * len(PROMPT)
    assert idle(engine)


def test_cancelling_the_first_choice_mid_prefill_hands_the_prefill_on(make_engine, tok):
    """Choice 0 prefills for all; cancelled after two of its five prompt chunks, choice 1 carries
    on from its cache, and choices 1 and 2 give what they give uncancelled."""
    prompt = PROMPT * 4
    want = results(make_engine(HashModel(), tok, prefill_tokens=8).submit_choices(prompt, SAMPLED, 3))
    model = HashModel()
    engine = make_engine(model, tok, prefill_tokens=8)
    gate, forward_batch = threading.Event(), model.forward_batch

    def gated(rows, caches, **kw):  # the third pass waits until the test has cancelled
        if len(model.passes) == 2:
            gate.wait()
        return forward_batch(rows, caches, **kw)

    model.forward_batch = gated
    handles = engine.submit_choices(prompt, SAMPLED, 3)
    wait_until(lambda: len(model.passes) == 2)
    handles[0].cancel()
    gate.set()
    with pytest.raises(RequestCancelledError):
        handles[0].result()
    assert results(handles[1:]) == want[1:]
    assert prompt_rows(model, prompt) == len(prompt)  # the chunks were not run again
    assert engine.stats()["cancelled"] == 1 and idle(engine)


def test_cancelling_choices_before_admission_and_while_waiting_for_the_prompt(make_engine, tok):
    engine = make_engine(HashModel(delay=0.01), tok, prefill_tokens=8)
    with engine.held():  # cancelled while queued: the first is gone before any step
        handles = engine.submit_choices(PROMPT * 4, SAMPLED, 3)
        handles[0].cancel()
    want = results(make_engine(HashModel(), tok, prefill_tokens=8).submit_choices(PROMPT * 4, SAMPLED, 3))
    assert results(handles[1:]) == want[1:]
    handles = engine.submit_choices(PROMPT * 4, SAMPLED, 3)
    handles[2].cancel()  # a follower: it never gets a copy
    assert results(handles[:2]) == want[:2]
    assert engine.stats()["cancelled"] == 2 and idle(engine)


def test_n_sequences_hold_a_block_each(make_engine, tok):
    model = HashModel(delay=0.01)
    engine = make_engine(model, tok)
    params = dataclasses.replace(GREEDY, max_tokens=4)
    handles = engine.submit_choices(PROMPT, params, 3)
    wait_until(lambda: engine.stats()["kv_tokens"] == 3 * (len(PROMPT) + 1))
    stats = engine.stats()
    # the fakes' caches share nothing: a block of 16 positions each for 11 positions
    assert (stats["active"], stats["kv_blocks_used"], stats["kv_bytes"]) == (3, 3, 3 * 16 * 32)
    results(handles)
    assert idle(engine)


def test_a_request_whose_choices_cannot_fit_together_is_refused(make_engine, tok):
    # 100 positions of the fake model: 6 blocks of 16; 10 + 20 positions take 2 blocks
    engine = make_engine(HashModel(), tok, kv_budget=32 * 100)
    assert len(engine.submit_choices(PROMPT, dataclasses.replace(GREEDY, max_tokens=20), 3)) == 3
    with pytest.raises(KVBudgetError, match="for each of n=4 choices") as info:
        engine.submit_choices(PROMPT, dataclasses.replace(GREEDY, max_tokens=20), 4)
    assert info.value.n == 4 and info.value.need_bytes == 4 * 2 * 16 * 32
    # max_tokens unset: each choice gets its share of the pool, 3 blocks.
    handles = engine.submit_choices(PROMPT, SamplingParams(temperature=0.0), 2)
    assert [h.result().stats.generated_tokens for h in handles] == [3 * 16 - len(PROMPT)] * 2


def test_groups_wait_for_free_slots_together(make_engine, tok):
    engine = make_engine(HashModel(delay=0.005), tok, max_active=4)
    first = engine.submit_choices(PROMPT, GREEDY, 3)
    second = engine.submit_choices(PROMPT, GREEDY, 2)
    wait_until(lambda: engine.stats()["active"] == 3)
    assert engine.stats()["queued"] == 2
    assert results(first) + results(second) == results([engine.submit(PROMPT, GREEDY)]) * 5


def test_a_default_engine_runs_64_choices_and_refuses_65_naming_max_active(make_engine, tok):
    """README, "Parameters": ``n`` is bounded by ``max_active`` (64 by default, not a setting)."""
    engine = make_engine(HashModel(), tok)
    handles = engine.submit_choices(PROMPT, dataclasses.replace(GREEDY, max_tokens=2), 64)
    assert len(results(handles)) == 64
    with pytest.raises(InvalidRequestError, match=r"n=65 choices are more than engine 'fake' runs at once "
                                                  r"\(max_active=64\)") as info:
        engine.submit_choices(PROMPT, GREEDY, 65)
    assert info.value.param == "n"


@pytest.mark.parametrize("n", [0, 5, True, 2.0])
def test_bad_n_is_named(make_engine, tok, n):
    engine = make_engine(HashModel(), tok, max_active=4)
    with pytest.raises(InvalidRequestError) as info:
        engine.submit_choices(PROMPT, GREEDY, n)
    assert info.value.param == "n"


def test_a_choice_with_no_block_for_its_copy_prefills_the_prompt_itself(make_engine, tok):
    """The fakes' copies take blocks of their own (2 for a 20-token prompt). In a pool of 7 blocks,
    beside a request holding 2, the third choice finds 1 block left at the fork: it prefills the
    prompt on its own later, and every sequence ends with what it has in a roomy pool."""
    other, prompt = [9] * 30, list(range(1, 21))
    params = dataclasses.replace(SAMPLED, max_tokens=10, ignore_eos=True)

    def run(engine):
        with engine.held():
            beside = engine.submit(other, params)
            choices = engine.submit_choices(prompt, params, 3)
        return results([beside, *choices])

    want = run(make_engine(HashModel(), tok))
    engine = make_engine(HashModel(), tok, kv_budget=7 * 16 * 32)
    assert run(engine) == want
    assert engine.stats()["finished"] == 4 and idle(engine)
