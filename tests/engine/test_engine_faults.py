"""Fault isolation: a request whose forward pass raises (a kernel error injected by ``FaultyModel``,
at its prefill or in the middle of its decoding) fails alone with ``EngineFaultError``; the requests
beside it end with the tokens they have alone, the KV pool gets every block back, and the engine
serves the next request as before. With the fakes, with a speculative decoder on the tiny random
Llama, and on the embedded default model (quantized: every row's output is the same bits beside
any others, so "alone" is exact; its prefix cache on)."""

from __future__ import annotations

import pytest
from engine_fakes import FaultAt, FaultyModel, FakeTokenizer, HashModel, KernelFault
from spec_fakes import random_draft

from flm_runtime.errors import EngineFaultError
from flm_runtime.request import SamplingParams
from flm_runtime.speculation.speculative import SpeculativeDecoder

PROMPTS = [[1, 2, 3], [40, 41], [7] * 9, [200, 100, 50, 25]]
BAD = 2
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


def run_with_a_fault(engine, prompts, params, bad: int):
    """Submit ``prompts`` into one step; returns the tokens ``bad`` delivered before its error, the
    error, and the others' token ids (in order)."""
    with engine.held():
        handles = [engine.submit(p, params) for p in prompts]
    delivered = []
    with pytest.raises(EngineFaultError) as info:
        for event in handles[bad]:
            delivered += event.token_ids
    others = [h.result(timeout=120).token_ids for i, h in enumerate(handles) if i != bad]
    return delivered, info.value, others


def check_fault_isolated(engine, faulty, alone, prompts, bad: int, at: int, params) -> None:
    """The whole check, on ``engine`` whose model is ``faulty`` (``FaultAt(prompts[bad], at)``)."""
    free = engine.pool.available
    delivered, error, others = run_with_a_fault(engine, prompts, params, bad)
    assert isinstance(error.__cause__, KernelFault) and "failed on this request" in str(error)
    assert faulty.faults >= 1
    assert others == [a for i, a in enumerate(alone) if i != bad]
    assert tuple(delivered) == alone[bad][: len(delivered)]
    if at == 0:
        assert delivered == []
    stats = engine.stats()
    assert (stats["failed"], stats["finished"], stats["kv_blocks_used"]) == (1, len(prompts) - 1, 0)
    with engine.held():
        engine.pool.clear_cached()  # the blocks the prefix cache kept of the finished requests
        assert engine.pool.available == free
    # The engine goes on: a new request gets its output alone.
    assert engine.submit(prompts[0], params).result(timeout=120).token_ids == alone[0]


@pytest.mark.parametrize("at", [0, len(PROMPTS[BAD]) + 3], ids=["at prefill", "mid-generation"])
def test_a_faulting_request_fails_alone_on_the_fakes(make_engine, tok, at):
    alone_engine = make_engine(HashModel(), tok)
    alone = [alone_engine.submit(p, GREEDY).result().token_ids for p in PROMPTS]
    faulty = FaultyModel(HashModel(), FaultAt(PROMPTS[BAD], at))
    check_fault_isolated(make_engine(faulty, tok), faulty, alone, PROMPTS, BAD, at, GREEDY)


@pytest.mark.parametrize("at", [0, len(PROMPTS[BAD]) + 3], ids=["at prefill", "mid-generation"])
def test_a_faulting_request_fails_alone_with_a_speculative_decoder(make_engine, tiny, at):
    tok = FakeTokenizer(vocab_size=300)
    plain = make_engine(tiny, tok)
    alone = [plain.submit(p, GREEDY).result().token_ids for p in PROMPTS]
    faulty = FaultyModel(tiny, FaultAt(PROMPTS[BAD], at))
    engine = make_engine(faulty, tok, speculative=SpeculativeDecoder(faulty, random_draft(tiny, taps=[0, 2])))
    check_fault_isolated(engine, faulty, alone, PROMPTS, BAD, at, GREEDY)


@pytest.mark.parametrize("at", [0, 3], ids=["at prefill", "mid-generation"])
def test_a_faulting_request_fails_alone_on_smollm2(make_engine, smollm2_quantized, smollm2_tokenizer, at):
    tok = smollm2_tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True))
               for question in ("What is the capital of France?", "Name three colours.", "Count from one to ten.",
                                "Why is the sky blue?")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = make_engine(smollm2_quantized, tok, name="alone", prefix_cache=False)
    alone = [plain.submit(p, params).result(timeout=120).token_ids for p in prompts]
    at = at and len(prompts[BAD]) + at
    faulty = FaultyModel(smollm2_quantized, FaultAt(prompts[BAD], at))
    engine = make_engine(faulty, tok, name="faulty")
    assert engine.prefix  # the failed request's blocks must not be registered
    check_fault_isolated(engine, faulty, alone, prompts, BAD, at, params)


def test_a_fault_of_every_request_fails_every_request(make_engine, tok):
    """A pass that raises for each sequence alone is not one request's fault: every request ends
    with it, the queued one too, and the pool is whole again."""
    faulty = FaultyModel(HashModel(), lambda ids, cache: True)
    engine = make_engine(faulty, tok, max_active=3)
    with engine.held():
        handles = [engine.submit(p, GREEDY) for p in PROMPTS]
    for handle in handles:
        with pytest.raises(EngineFaultError, match="on no single request"):
            handle.result(timeout=60)
    assert engine.stats()["failed"] == 4 and engine.pool.available == engine.pool.n_blocks


def test_a_prompt_that_faults_alone_fails_its_choices_too(make_engine, tok):
    """A request of 3 choices whose prompt faults at prefill: its leader fails, the next choice
    takes the prompt over and faults as well, and so on; the request beside them is untouched."""
    faulty = FaultyModel(HashModel(), FaultAt(PROMPTS[BAD], 0))
    engine = make_engine(faulty, tok)
    alone = make_engine(HashModel(), tok).submit(PROMPTS[0], GREEDY).result().token_ids
    with engine.held():
        choices = engine.submit_choices(PROMPTS[BAD], GREEDY, 3)
        good = engine.submit(PROMPTS[0], GREEDY)
    for handle in choices:
        with pytest.raises(EngineFaultError):
            handle.result(timeout=60)
    assert good.result(timeout=60).token_ids == alone
    assert engine.stats()["kv_blocks_used"] == 0 and engine.pool.available == engine.pool.n_blocks
