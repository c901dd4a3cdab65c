"""Embeddings of the real smollm2:135m through ``litellm.embedding`` / ``aembedding`` and a Router,
and ``flm_runtime.embedding.embed`` itself (docs/design.md, "Embeddings").

The suite's shared engine runs the float32 weights; the quantized model (``smollm2_quantized``)
is where a row's result is the same bits in any batch, so exact equalities are asserted there.
"""

from __future__ import annotations

import base64

import litellm
import numpy as np
import pytest

from flm_runtime.kernels import cpu
from flm_runtime.embedding import _groups, embed

TAG = "smollm2:135m"
MODEL = f"flm/{TAG}"
HIDDEN = 576  # SmolLM2-135M's hidden size (docs/design.md, "The embedded model")

# Three pairs of paraphrases, each pair about something else.
PARAPHRASES = [
    ("The cat sat on the mat.", "A cat was sitting on the rug."),
    ("The weather is nice today.", "It is sunny and warm outside."),
    ("How do I bake bread?", "Recipe for making bread at home."),
]
UNRELATED = "Stock markets fell sharply on Monday."
TEXTS = [t for pair in PARAPHRASES for t in pair] + [UNRELATED]


def vectors(response) -> np.ndarray:
    assert [d["index"] for d in response.data] == list(range(len(response.data)))
    return np.array([d["embedding"] for d in response.data], dtype=np.float64)


@pytest.fixture(scope="module")
def batch(smollm2_engine):
    """The embeddings of TEXTS, in one call."""
    return litellm.embedding(model=MODEL, input=TEXTS)


def test_one_unit_vector_of_the_hidden_size_per_text_and_real_usage(batch, smollm2_tokenizer):
    v = vectors(batch)
    assert v.shape == (len(TEXTS), HIDDEN)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(v.astype(np.float32), v)  # float32 values
    n_tokens = sum(len(smollm2_tokenizer.encode(t)) for t in TEXTS)
    assert (batch.usage.prompt_tokens, batch.usage.total_tokens) == (n_tokens, n_tokens)
    assert batch.model == MODEL


def test_paraphrases_are_closer_than_unrelated_texts(batch):
    # Measured (f32 and quantized alike): paraphrase pairs 0.952, 0.949, 0.938; every other pair
    # of these texts at most 0.874.
    v = vectors(batch)
    cos = v @ v.T
    pairs = {(2 * i, 2 * i + 1) for i in range(len(PARAPHRASES))}
    paraphrase = [cos[a, b] for a, b in sorted(pairs)]
    others = [cos[a, b] for a in range(len(TEXTS)) for b in range(a + 1, len(TEXTS)) if (a, b) not in pairs]
    assert min(paraphrase) > 0.92, paraphrase
    assert max(others) < 0.90, max(others)


def test_a_text_alone_equals_the_same_text_in_a_batch(batch):
    for i in (0, 3, len(TEXTS) - 1):
        alone = vectors(litellm.embedding(model=MODEL, input=TEXTS[i]))[0]
        np.testing.assert_allclose(alone, vectors(batch)[i], rtol=0, atol=2e-6)  # f32: BLAS rounding
    assert np.array_equal(vectors(litellm.embedding(model=MODEL, input=TEXTS)), vectors(batch))  # deterministic


def test_quantized_model_alone_and_batched_are_the_same_bits(smollm2_quantized, smollm2_tokenizer):
    ids = [smollm2_tokenizer.encode(t) for t in TEXTS]
    together = embed(smollm2_quantized, ids)
    assert together.dtype == np.float32 and together.shape == (len(TEXTS), HIDDEN)
    alone = np.stack([embed(smollm2_quantized, [x])[0] for x in ids])
    assert np.array_equal(together, alone)
    reversed_batch = embed(smollm2_quantized, ids[::-1])[::-1]
    assert np.array_equal(together, reversed_batch)


def test_a_text_longer_than_a_prefill_chunk_is_pooled_over_every_position(smollm2_quantized, smollm2_tokenizer):
    model = smollm2_quantized
    ids = smollm2_tokenizer.encode(" ".join(TEXTS * 12))
    assert len(ids) > 2 * model.prefill_chunk
    # Reference: the whole text in one step, its final normed hidden states averaged.
    taps = model.forward_batch([np.array(ids)], [model.new_cache()], taps=(model.config.num_hidden_layers - 1,),
                               logit_rows=[0]).taps
    mean = cpu.rms_norm(taps, model.norm, model.config.rms_norm_eps).astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(embed(model, [ids])[0], mean / np.linalg.norm(mean), rtol=0, atol=1e-6)


def test_groups_hold_at_most_one_context_of_positions():
    assert _groups([3, 4, 2, 5], 7) == [[0, 1], [2, 3]]
    assert _groups([7, 1, 6], 7) == [[0], [1, 2]]
    assert _groups([2, 2, 2], 100) == [[0, 1, 2]]


def test_token_id_input_equals_its_text(smollm2_tokenizer):
    ids = [smollm2_tokenizer.encode(t) for t in TEXTS[:2]]
    texts = litellm.embedding(model=MODEL, input=TEXTS[:2])
    assert np.array_equal(vectors(litellm.embedding(model=MODEL, input=ids)), vectors(texts))
    one = litellm.embedding(model=MODEL, input=ids[0])  # a flat list of ids is one text
    assert np.array_equal(vectors(one), vectors(litellm.embedding(model=MODEL, input=TEXTS[0])))
    assert one.usage.prompt_tokens == len(ids[0])


async def test_aembedding_and_a_router_equal_embedding(batch):
    assert np.array_equal(vectors(await litellm.aembedding(model=MODEL, input=TEXTS)), vectors(batch))
    router = litellm.Router(model_list=[{"model_name": "local", "litellm_params": {"model": MODEL}}])
    assert np.array_equal(vectors(router.embedding(model="local", input=TEXTS)), vectors(batch))
    assert np.array_equal(vectors(await router.aembedding(model="local", input=TEXTS)), vectors(batch))


def test_the_dflash_tag_embeds_with_its_target(batch):
    r = litellm.embedding(model="flm/smollm2-dflash:135m", input=TEXTS)
    assert np.array_equal(vectors(r), vectors(batch))


def test_base64_is_the_little_endian_float32_bytes(batch):
    # LiteLLM drops encoding_format before a custom provider sees it (additional_drop_params here);
    # behind the proxy the handler reads it from the HTTP request's body, as simulated here.
    r = litellm.embedding(model=MODEL, input=TEXTS, additional_drop_params=["encoding_format"],
                          encoding_format="base64", proxy_server_request={"body": {"encoding_format": "base64"}})
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.data])
    assert np.array_equal(decoded, vectors(batch))


def test_litellm_refuses_encoding_format_for_a_custom_provider_unless_dropped(smollm2_engine):
    with pytest.raises(litellm.BadRequestError, match="encoding_format"):
        litellm.embedding(model=MODEL, input=["a"], encoding_format="float")
    r = litellm.embedding(model=MODEL, input=["a"], encoding_format="base64", drop_params=True)
    assert isinstance(r.data[0]["embedding"], list)  # dropped: the handler never knew


@pytest.mark.parametrize("input, name", [
    ("", "input[0]"), ([], "input"), (["a", ""], "input[1]"), ([[]], "input[0]"), (["a", 3.5], "input[1]"),
    ([[1, 10**6]], "input[0]"),  # a token id outside the vocabulary
])
def test_bad_input_is_a_bad_request_naming_it(smollm2_engine, input, name):
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.embedding(model=MODEL, input=input)
    assert info.value.body["param"] == name


def test_bad_encoding_format_is_named(smollm2_engine):
    with pytest.raises(litellm.BadRequestError) as info:
        litellm.embedding(model=MODEL, input=["a"], proxy_server_request={"body": {"encoding_format": "binary"}})
    assert info.value.body["param"] == "encoding_format"


def test_a_text_over_the_context_is_a_context_window_error_naming_it(smollm2_engine):
    long = "hello " * (smollm2_engine.context_length + 10)
    with pytest.raises(litellm.ContextWindowExceededError) as info:
        litellm.embedding(model=MODEL, input=["short", long])
    assert info.value.body["param"] == "input[1]"
    n_tokens = len(smollm2_engine.tokenizer.encode(long))
    assert (f"this model's context length is {smollm2_engine.context_length} tokens; the text has {n_tokens} tokens"
            in str(info.value))
