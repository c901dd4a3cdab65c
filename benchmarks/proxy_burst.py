"""A burst of requests through a LiteLLM proxy serving local flm models: failures, latency, tokens/s.

Starts ``litellm --config examples/proxy_burst_config.yaml`` (two ``flm/`` deployments in one model
group, a fallback group) on 127.0.0.1, sends one request to load the model, then fires
``--requests`` chat completions at once from an async OpenAI SDK client (no client retries: any
failure is counted), each a different question, ``--max-tokens`` tokens, greedy. Reports how many
succeeded and failed (and why), latency percentiles (seconds from the burst's start to each
response), completion tokens/s of the whole burst (all tokens over the burst's wall time), and the
engine stats of the proxy's last log line (``FLM_LOG_LEVEL=INFO``): nothing should be left
running, queued or holding KV memory. The proxy is always stopped.

    python benchmarks/proxy_burst.py [--config examples/proxy_burst_config.yaml] [--requests 200]
        [--max-tokens 16] [--model smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
STARTUP_S = 300
ENGINE_LINE = re.compile(r"flm_runtime\.scheduling\.engine (?:DEBUG|INFO): request \w+; engine stats (\{.*\})")
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a library", "rain", "a bicycle", "tea", "winter", "a river"]
ASKS = ["Write one sentence about {}.", "Give me a fact about {}.", "Describe {} in a few words.",
        "What rhymes with {}?"]


def start_proxy(config: Path, log: Path) -> tuple[subprocess.Popen, str, str]:
    """``litellm --config`` on a free port of 127.0.0.1; returns (process, base URL, master key)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = f"sk-{secrets.token_hex(32)}"
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_MASTER_KEY=key)
    cmd = [str(Path(sys.executable).with_name("litellm")), "--config", str(config), "--host", "127.0.0.1",
           "--port", str(port), "--telemetry", "False"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + STARTUP_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/liveliness", timeout=2):
                return proc, f"http://127.0.0.1:{port}/v1", key
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the proxy did not start:\n{log.read_text(errors='replace')[-3000:]}")


async def one(client: openai.AsyncOpenAI, model: str, question: str, max_tokens: int, t0: float) -> dict:
    """One request: its latency (seconds since ``t0``), completion tokens, and error (None if it succeeded)."""
    try:
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                 max_tokens=max_tokens, temperature=0)
        return {"latency": time.perf_counter() - t0, "tokens": r.usage.completion_tokens, "error": None}
    except openai.APIError as e:
        return {"latency": time.perf_counter() - t0, "tokens": 0, "error": f"{type(e).__name__}: {e}"}


async def burst(url: str, key: str, model: str, n: int, max_tokens: int) -> tuple[list[dict], float]:
    """Warm up with one request, then ``n`` at once; returns (per-request results, burst seconds)."""
    client = openai.AsyncOpenAI(base_url=url, api_key=key, timeout=900, max_retries=0)
    warm = await one(client, model, "Hello!", 4, time.perf_counter())
    assert warm["error"] is None, f"the warm-up request failed: {warm['error']}"
    questions = [ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)]) + f" ({i})" for i in range(n)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(client, model, q, max_tokens, t0) for q in questions))
    return results, time.perf_counter() - t0


def report(results: list[dict], seconds: float, log: Path) -> None:
    ok = [r for r in results if r["error"] is None]
    errors = collections.Counter(r["error"].split(":")[0] for r in results if r["error"])
    latencies = sorted(r["latency"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    print(f"requests: {len(results)}; succeeded: {len(ok)}; failed: {len(results) - len(ok)} {dict(errors)}")
    if latencies:
        q = statistics.quantiles(latencies, n=100, method="inclusive")
        print(f"latency s: p50 {q[49]:.1f}, p90 {q[89]:.1f}, p99 {q[98]:.1f}, max {latencies[-1]:.1f}")
    print(f"completion tokens: {tokens} in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s (whole burst)")
    for r in results:
        if r["error"]:
            print(f"  {r['error'][:300]}")
    lines = ENGINE_LINE.findall(log.read_text(errors="replace"))
    if lines:
        stats = [json.loads(line) for line in lines]
        print(f"engine stats after the last request: {lines[-1]}")
        print(f"most requests queued at once (at a request's end): {max(s['queued'] for s in stats)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "examples" / "proxy_burst_config.yaml")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="smollm2", help="the model group to call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flm-burst-") as tmp:
        log = Path(tmp) / "proxy.log"
        proc, url, key = start_proxy(args.config, log)
        try:
            results, seconds = asyncio.run(burst(url, key, args.model, args.requests, args.max_tokens))
            print(f"config {args.config.relative_to(REPO) if args.config.is_relative_to(REPO) else args.config}; "
                  f"{args.requests} requests at once, max_tokens {args.max_tokens}, greedy")
            report(results, seconds, log)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
