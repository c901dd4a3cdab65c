"""The one-call stack (``layers/stack.py``) of a quantized model: the same bits for every row, alone
or beside other sequences, with taps and logit rows chosen per sequence, on any number of kernel
threads."""

from __future__ import annotations

import numpy as np
import pytest

from flm_runtime.kernels.team import Team
from flm_runtime.layers.stack import Stack
from flm_runtime.outputs import ForwardOutput


def _steps(model, verify_rows=3):
    """A prefill of two sequences beside a third, then a step of one decode row beside a verify
    pass of ``verify_rows`` rows: each step's output and both caches' keys and values."""
    ids = np.arange(1, 41)
    a, b, c = model.new_cache(), model.new_cache(), model.new_cache()
    first = model.forward_batch([ids[:7], ids, ids[3:20]], [a, b, c], logit_rows=[1, 5, 0], taps=(1, 5))
    second = model.forward_batch([np.array([7]), np.arange(3, 3 + verify_rows)], [a, b],
                                 logit_rows=[1, verify_rows])
    return first, second, [(x.keys(), x.values()) for x in (a, b)]


def _assert_same(got, want):
    (g1, g2, g_caches), (w1, w2, w_caches) = got, want
    assert np.array_equal(g1.logits, w1.logits) and np.array_equal(g1.taps, w1.taps)
    assert np.array_equal(g2.logits, w2.logits) and g2.taps is None
    for (gk, gv), (wk, wv) in zip(g_caches, w_caches):
        assert np.array_equal(gk, wk) and np.array_equal(gv, wv)


def _alone(model, verify_rows=3):
    """``_steps``' steps of each sequence alone, in ``_steps``' form."""
    ids = np.arange(1, 41)
    a, b, c = model.new_cache(), model.new_cache(), model.new_cache()
    firsts = [model.forward_batch([rows], [cache], logit_rows=[n], taps=(1, 5))
              for rows, cache, n in ((ids[:7], a, 1), (ids, b, 5), (ids[3:20], c, 0))]
    seconds = [model.forward_batch([rows], [cache], logit_rows=[n])
               for rows, cache, n in ((np.array([7]), a, 1), (np.arange(3, 3 + verify_rows), b, verify_rows))]
    first = ForwardOutput(np.concatenate([f.logits for f in firsts]), np.concatenate([f.taps for f in firsts]))
    second = ForwardOutput(np.concatenate([f.logits for f in seconds]), None)
    return first, second, [(x.keys(), x.values()) for x in (a, b)]


@pytest.mark.parametrize("verify_rows", [3, 16])
def test_a_batched_step_gives_each_sequence_its_bits_alone(smollm2_quantized, verify_rows):
    model = smollm2_quantized
    assert model.stack is not None
    _assert_same(_steps(model, verify_rows), _alone(model, verify_rows))


def test_a_sequence_alone_gets_the_bits_it_gets_in_a_batch(smollm2_quantized):
    model = smollm2_quantized
    ids = np.arange(1, 41)
    alone = model.forward_batch([ids], [model.new_cache()], logit_rows=[5], taps=(1, 5))
    batched = model.forward_batch([ids[:7], ids], [model.new_cache(), model.new_cache()], logit_rows=[1, 5],
                                  taps=(1, 5))
    assert np.array_equal(alone.logits, batched.logits[1:]) and np.array_equal(alone.taps, batched.taps[7:])


@pytest.mark.parametrize("threads", [1, 3])
def test_the_stack_gives_the_same_bits_on_any_number_of_threads(smollm2_quantized, monkeypatch, threads):
    model = smollm2_quantized
    want = _steps(model)
    team = Team(threads)
    try:
        monkeypatch.setattr(model, "stack", Stack(model.stack.weights, model.stack.specs, model.stack.vocab, team))
        _assert_same(_steps(model), want)
    finally:
        team.close()


def test_the_layers_matrices_are_views_of_the_stacked_weights(smollm2_quantized):
    model = smollm2_quantized
    stacked = model.stack.weights
    for m in (*model.layers[0].matrices, *model.layers[-1].matrices, model.lm_head):
        assert np.shares_memory(m.codes, stacked.codes) and np.shares_memory(m.scales, stacked.scales)
    assert model.embed is model.lm_head  # tied: one copy
    assert stacked.matrices.shape == (model.config.num_hidden_layers + 1, 4, 6)
