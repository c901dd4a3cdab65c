"""The scheduler alone: no engine thread, no model. Its pool is a ``BlockPool`` of ``FAKE_BLOCK``
(16) positions per block, its caches ``FakeCache``s; ``run`` plays a step's pass and its outcome as
the engine does (each part's rows go into its cache, a finished prompt forks its choices, every
sequence whose rows gave logits takes ``TOKEN``). Each test states the exact plan: which sequences
prefill how many tokens (and whether they pick a token), which decode, which are preempted.
"""

from __future__ import annotations

import numpy as np
from engine_fakes import FAKE_BLOCK, FakeCache, FakeTokenizer

from flm_runtime.kv_cache import BlockPool, BlockTable
from flm_runtime.request import SamplingParams
from flm_runtime.scheduling.handle import RequestHandle
from flm_runtime.scheduling.scheduler import Scheduler, StepPlan
from flm_runtime.scheduling.sequence import Sequence, Status

CONTEXT = 256
TOKEN = ord("x")
TOK = FakeTokenizer(vocab_size=300)


def new_scheduler(blocks: int, *, max_active: int = 8, prefill_tokens: int = 64, prefill_chunk: int = 64,
                  decode_rows: int = 1, prefix: bool = False,
                  cache=lambda pool: FakeCache(0, CONTEXT, pool)) -> Scheduler:
    """A scheduler over a pool of ``blocks`` blocks whose caches are ``cache(pool)``."""
    pool = BlockPool(blocks, FAKE_BLOCK)
    return Scheduler(pool, lambda: cache(pool), max_active=max_active, prefill_tokens=prefill_tokens,
                     prefill_chunk=prefill_chunk, decode_rows=decode_rows, prefix=prefix)


def request(scheduler: Scheduler, n_prompt: int, n: int = 1) -> list[Sequence]:
    """Queue a request of ``n`` choices of the prompt ``1 .. n_prompt``; its sequences."""
    prompt = np.arange(1, n_prompt + 1, dtype=np.int64)
    head, *followers = [Sequence(RequestHandle(), prompt, SamplingParams(max_tokens=100), 100, TOK) for _ in range(n)]
    head.followers = followers
    for seq in followers:
        seq.leader = head
    scheduler.add(head)
    return [head, *followers]


def admit(scheduler: Scheduler) -> list[list[Sequence]]:
    """Admit what fits and allocate each admitted request's caches, as the engine does; the
    admitted groups."""
    groups = scheduler.admit()
    for group in groups:
        scheduler.allocate(group)
    return groups


def run(scheduler: Scheduler, plan: StepPlan) -> None:
    for chunk in plan.prefill:
        chunk.seq.cache.append(chunk.ids)
        forked = scheduler.prompt_written(chunk.seq)
        if chunk.n_logits:
            for seq in [chunk.seq, *forked]:
                seq.accept(TOKEN)
    for seq in plan.decode:
        seq.cache.append([seq.last_token])
        seq.accept(TOKEN)


def chunks(plan: StepPlan) -> list[tuple[Sequence, int, int]]:
    """Each prompt chunk of the plan: its sequence, its tokens, its logit rows."""
    return [(c.seq, len(c.ids), c.n_logits) for c in plan.prefill]


def test_prompt_chunks_take_the_step_budget_in_admission_order():
    """Chunks of 16 within 32 tokens a step: ``c``'s 16 do not fit beside ``a``'s 16 and ``b``'s
    10, and wait a step; each prompt's last chunk asks for its logits, and ``b`` decodes beside
    the others' chunks once its prompt is in."""
    scheduler = new_scheduler(64, prefill_tokens=32, prefill_chunk=16)
    (a,), (b,), (c,) = request(scheduler, 40), request(scheduler, 10), request(scheduler, 20)
    assert admit(scheduler) == [[a], [b], [c]]
    assert [s.status for s in (a, b, c)] == [Status.PREFILLING] * 3
    plan = scheduler.schedule()
    assert chunks(plan) == [(a, 16, 0), (b, 10, 1)] and plan.decode == () and plan.preempted == ()
    np.testing.assert_array_equal(plan.prefill[0].ids, a.prompt_ids[:16])
    run(scheduler, plan)
    assert (a.status, b.status, b.last_token) == (Status.PREFILLING, Status.DECODING, TOKEN)
    plan = scheduler.schedule()
    assert chunks(plan) == [(a, 16, 0), (c, 16, 0)] and plan.decode == (b,)
    np.testing.assert_array_equal(plan.prefill[0].ids, a.prompt_ids[16:32])
    run(scheduler, plan)
    plan = scheduler.schedule()
    assert chunks(plan) == [(a, 8, 1), (c, 4, 1)] and plan.decode == (b,)


def test_admission_keeps_arrival_order_and_counts_blocks_and_slots():
    """8 blocks: the first 60-token prompt takes 4, the second's 4 are more than the 4 left less a
    block for the running one, and the 10-token prompt behind it waits too. Three choices need
    three slots of the three, so they wait while one runs."""
    scheduler = new_scheduler(8)
    (first,), (second,), (small,) = request(scheduler, 60), request(scheduler, 60), request(scheduler, 10)
    assert scheduler.admittable() == 1 and admit(scheduler) == [[first]]
    assert list(scheduler.waiting) == [second, small] and second.status is small.status is Status.WAITING

    scheduler = new_scheduler(64, max_active=3)
    (one,) = request(scheduler, 10)
    trio = request(scheduler, 10, n=3)
    assert admit(scheduler) == [[one]] and scheduler.queued() == trio
    scheduler.finish(one, keep=False)
    assert one.status is Status.FINISHED and admit(scheduler) == [trio]
    assert [s.status for s in trio] == [Status.PREFILLING, Status.FOLLOWING, Status.FOLLOWING]
    assert chunks(scheduler.schedule()) == [(trio[0], 10, 1)]


def test_an_older_decoding_sequence_preempts_the_youngest_even_prefilling():
    """Blocks of 20 rows a decoding step (a speculative block): ``r1`` at 32 positions takes the
    last 2 blocks, ``r2`` at 16 needs 2 more, so the youngest, ``r3`` (prefilling), goes back to
    the head of the queue and its blocks make the room."""
    scheduler = new_scheduler(7, decode_rows=20)
    (r1,), (r2,) = request(scheduler, 32), request(scheduler, 16)
    admit(scheduler)
    plan = scheduler.schedule()
    assert chunks(plan) == [(r1, 32, 1), (r2, 16, 1)]
    run(scheduler, plan)
    (r3,) = request(scheduler, 20)
    assert admit(scheduler) == [[r3]] and scheduler.pool.available == 2
    plan = scheduler.schedule()
    assert plan.decode == (r1, r2) and plan.preempted == (r3,) and plan.prefill == ()
    assert r3.status is Status.WAITING and r3.cache is None and list(scheduler.waiting) == [r3]
    assert scheduler.active == [r1, r2] and scheduler.pool.available == 0


def test_the_youngest_preempts_itself_and_resumes_with_its_context():
    """5 blocks, two 31-token prompts of 2 each: at 32 positions each needs a third, ``r1`` takes
    the last one and ``r2``, the youngest, goes; admitted again, it prefills its prompt and the
    token it fed (32 tokens) and picks no token, then decodes on."""
    scheduler = new_scheduler(5)
    (r1,), (r2,) = request(scheduler, 31), request(scheduler, 31)
    assert admit(scheduler) == [[r1], [r2]]
    for _ in range(2):  # the prompts, then a decoding step in the blocks they hold
        run(scheduler, scheduler.schedule())
    plan = scheduler.schedule()
    assert plan.decode == (r1,) and plan.preempted == (r2,) and plan.prefill == ()
    assert r2.status is Status.WAITING and r2.resumed and r2.preemptions == 1
    np.testing.assert_array_equal(r2.prefill_ids, [*r2.prompt_ids, TOKEN])
    run(scheduler, plan)
    scheduler.finish(r1, keep=False)
    assert admit(scheduler) == [[r2]]
    plan = scheduler.schedule()
    assert chunks(plan) == [(r2, 32, 0)] and plan.decode == ()
    run(scheduler, plan)
    assert r2.status is Status.DECODING and scheduler.schedule().decode == (r2,)


def test_a_prompt_forks_its_choices_and_one_without_room_goes_back_to_the_queue():
    """Three choices of a 20-token prompt (2 blocks): only the head prefills; then the first
    follower's copy takes 2 of the 3 blocks left and the second finds none: it waits at the head
    of the queue, to prefill the prompt itself."""
    scheduler = new_scheduler(5)
    head, f1, f2 = request(scheduler, 20, n=3)
    assert admit(scheduler) == [[head, f1, f2]]
    plan = scheduler.schedule()
    assert chunks(plan) == [(head, 20, 1)] and plan.decode == ()
    run(scheduler, plan)
    assert [s.status for s in (head, f1, f2)] == [Status.DECODING, Status.DECODING, Status.WAITING]
    assert f1.last_token == TOKEN and f1.cache.length == 20 and f2.cache is None and f2.leader is None
    assert scheduler.active == [head, f1] and list(scheduler.waiting) == [f2] and head.followers == []
    assert scheduler.schedule().decode == (head, f1)


def test_caches_that_cannot_be_copied_give_each_choice_a_prefill_of_its_own():
    """``BlockTable.copy`` None (the npu backend's caches): admitted, the three choices are on
    their own, each with its prompt's blocks, and each prefills the prompt."""
    scheduler = new_scheduler(16, cache=lambda pool: BlockTable(pool, CONTEXT))
    head, f1, f2 = request(scheduler, 20, n=3)
    assert admit(scheduler) == [[head, f1, f2]]
    assert [s.status for s in (head, f1, f2)] == [Status.PREFILLING] * 3
    assert head.followers == [] and f1.leader is f2.leader is None and scheduler.pool.used == 6
    assert chunks(scheduler.schedule()) == [(head, 20, 1), (f1, 20, 1), (f2, 20, 1)]


def test_a_head_that_ends_mid_prefill_hands_its_cache_and_choices_on():
    scheduler = new_scheduler(16, prefill_tokens=16, prefill_chunk=16)
    head, f1, f2 = request(scheduler, 40, n=3)
    admit(scheduler)
    run(scheduler, scheduler.schedule())
    scheduler.finish(head, keep=False)
    assert head.status is Status.FINISHED and scheduler.active == [f1, f2]
    assert f1.status is Status.PREFILLING and f1.cache.length == 16 and f2.leader is f1 and f1.followers == [f2]
    plan = scheduler.schedule()
    assert chunks(plan) == [(f1, 16, 0)]
    np.testing.assert_array_equal(plan.prefill[0].ids, f1.prompt_ids[16:32])


def test_a_queued_head_that_ends_leaves_its_place_in_the_queue_to_the_next_choice():
    scheduler = new_scheduler(8)
    (running,) = request(scheduler, 60)  # 4 of the 8 blocks
    admit(scheduler)
    head, f1 = request(scheduler, 60, n=2)  # 4 blocks and a copy's: more than the 3 left
    (later,) = request(scheduler, 10)
    assert admit(scheduler) == [] and list(scheduler.waiting) == [head, later]
    scheduler.finish(head, keep=False)
    assert list(scheduler.waiting) == [f1, later] and f1.status is Status.WAITING and f1.leader is None
    scheduler.finish(running, keep=False)
    assert admit(scheduler) == [[f1], [later]]


def test_a_finished_prompt_leaves_its_full_blocks_to_the_next_request():
    """With prefix caching, a 40-token prompt's two full blocks outlive its request: the same
    prompt again starts from them and prefills its last 8 tokens."""
    scheduler = new_scheduler(16, prefix=True)
    (first,) = request(scheduler, 40)
    admit(scheduler)
    run(scheduler, scheduler.schedule())
    scheduler.finish(first, keep=True)
    assert scheduler.pool.used == 0 and scheduler.pool.cached == 2
    (again,) = request(scheduler, 40)
    admit(scheduler)
    plan = scheduler.schedule()
    assert again.cached_tokens == 32 and chunks(plan) == [(again, 8, 1)]
    np.testing.assert_array_equal(plan.prefill[0].ids, again.prompt_ids[32:])
