"""Predicted outputs and the per-request speculation switch through LiteLLM, on ``smollm2:135m``
speculating on this host's verify curve: ``prediction`` is proposed and verified (the answer is
the one without it, token for token), its figures are OpenAI's usage fields, ``extra_body``'s
``speculation: false`` decodes plainly, and a malformed prediction is refused naming it."""

from __future__ import annotations

import litellm
import pytest

from flm_runtime import api, paths
from flm_runtime.settings import Settings

MODEL = "flm/smollm2:135m"
CODE = "".join(f"def f{k}(x):\n    return x + {k}\n\n" for k in range(6))
MESSAGES = [{"role": "user", "content": "Repeat this code exactly, nothing else:\n\n" + CODE}]
GREEDY = {"temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def speculating(tmp_path_factory):
    """The provider's runtime, replaced by one whose tags speculate on this host's verify curve,
    measured into a config folder of the module's own."""
    config = tmp_path_factory.mktemp("config")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paths, "config_dir", lambda: config)
        runtime = api.Runtime(Settings(host_costs="1"))
        mp.setattr(api, "default_runtime", runtime)
        yield runtime
        runtime.close()


def test_a_prediction_is_verified_and_reported_as_openai_does(speculating):
    plain = litellm.completion(model=MODEL, messages=MESSAGES, extra_body={"speculation": False}, **GREEDY)
    assert plain._hidden_params["flm_stats"]["spec_steps"] == 0
    predicted = litellm.completion(model=MODEL, messages=MESSAGES, prediction={"type": "content", "content": CODE},
                                   **GREEDY)
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    stats, details = predicted._hidden_params["flm_stats"], predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == stats["prediction_accepted_tokens"] > 0, stats
    assert details.rejected_prediction_tokens == stats["prediction_drafted_tokens"] - stats["prediction_accepted_tokens"]
    assert predicted.usage.completion_tokens == plain.usage.completion_tokens


def test_a_streamed_prediction_gives_the_same_answer_and_usage(speculating):
    request = dict(model=MODEL, messages=MESSAGES, **GREEDY,
                   prediction={"type": "content", "content": [{"type": "text", "text": CODE}]})
    whole = litellm.completion(**request)
    chunks = list(litellm.completion(**request, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed = chunks[-1].usage.completion_tokens_details
    assert streamed.accepted_prediction_tokens == whole.usage.completion_tokens_details.accepted_prediction_tokens


@pytest.mark.parametrize("prediction", [{"type": "content"}, {"type": "text", "content": "x"}, "x",
                                        {"type": "content", "content": [{"type": "image_url"}]}])
def test_a_malformed_prediction_is_refused_naming_it(speculating, prediction):
    with pytest.raises(litellm.BadRequestError, match="prediction must be"):
        litellm.completion(model=MODEL, messages=MESSAGES, prediction=prediction, **GREEDY)
