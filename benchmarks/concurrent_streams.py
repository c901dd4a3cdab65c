"""Aggregate tokens/s of N concurrent streaming requests through LiteLLM against one request alone.

Each round runs one streaming ``litellm.acompletion(model="flm/<tag>", stream=True)`` alone and
``--streams`` of them at once (different questions, greedy, ``ignore_eos`` so every request
generates exactly ``--max-tokens``), the two in alternating order from round to round so that
machine noise hits both alike. A run's tokens/s is the completion tokens of its requests (from the
final chunks' ``usage``) over the seconds from sending the first request to the last chunk of the
last one: prompt processing included, as a user sees it. The ratio of the two is what continuous
batching buys (the project's bar is at least 3x with 8 streams): the ratio within each round (both
runs saw about the same machine), its median and minimum over rounds, and the ratio of the medians.

    python benchmarks/concurrent_streams.py [--tag smollm2:135m] [--streams 8] [--max-tokens 128]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not fetch it

import litellm  # noqa: E402

import litellm_flm  # noqa: E402, F401 - registers the flm provider

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about a trip to the sea.",
    "Explain why the sky is blue.",
    "Describe the city of Paris to a child.",
    "Write a poem about the moon.",
    "Explain how bread is made.",
]


async def stream_tokens(model: str, question: str, max_tokens: int) -> int:
    """Stream one greedy request to the end; returns its completion tokens (final usage)."""
    response = await litellm.acompletion(model=model, messages=[{"role": "user", "content": question}],
                                         temperature=0, max_tokens=max_tokens, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = None
    async for chunk in response:
        usage = getattr(chunk, "usage", None) or usage
    return usage.completion_tokens


async def run(model: str, n: int, max_tokens: int) -> tuple[int, float]:
    """``n`` requests at once: (completion tokens in all, seconds from the first send to the last chunk)."""
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(stream_tokens(model, QUESTIONS[i % len(QUESTIONS)], max_tokens)
                                    for i in range(n)))
    return sum(tokens), time.perf_counter() - t0


async def measure(model: str, streams: int, max_tokens: int, rounds: int) -> dict[int, list[float]]:
    """Tokens/s per round of 1 and of ``streams`` concurrent requests, order alternating."""
    await run(model, 1, 4)  # load the model, warm the engine thread
    rates: dict[int, list[float]] = {1: [], streams: []}
    for r in range(rounds):
        for n in ((1, streams) if r % 2 == 0 else (streams, 1)):
            tokens, seconds = await run(model, n, max_tokens)
            assert tokens == n * max_tokens, f"{tokens} tokens from {n} requests of {max_tokens}"
            rates[n].append(tokens / seconds)
            print(f"round {r + 1}: {n} stream(s): {tokens} tokens in {seconds:.2f} s = "
                  f"{tokens / seconds:.1f} tokens/s", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="smollm2:135m")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rates = asyncio.run(measure(f"flm/{args.tag}", args.streams, args.max_tokens, args.rounds))
    single, many = rates[1], rates[args.streams]
    ratios = [m / s for s, m in zip(single, many)]
    print(f"model flm/{args.tag}; {args.max_tokens} tokens per request; {args.rounds} rounds, interleaved")
    one, all_ = statistics.median(single), statistics.median(many)
    print(f"medians: 1 stream {one:.1f} tokens/s; {args.streams} streams {all_:.1f} tokens/s aggregate; "
          f"ratio {all_ / one:.2f}x")
    print(f"ratio within each round: {', '.join(f'{r:.2f}x' for r in ratios)}; median "
          f"{statistics.median(ratios):.2f}x, minimum {min(ratios):.2f}x")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
