"""Three flm hosts behind a front LiteLLM proxy; one host killed mid-burst and restarted.

Everything on 127.0.0.1: Redis (Debian's ``redis-server``, started here on a free port, nothing
saved), three host proxies (``examples/deployment/host.yaml``) and the front proxy
(``examples/deployment/front.yaml``), each config as docs/deployment.md shows it, plus the
test's callback (``served_log.py``), which logs every call each proxy ends. The three hosts
start together, the front once the model's compiled step is cached.

A burst of ``REQUESTS`` chat completions (60; ``FLM_BURST_REQUESTS`` sets another count, 300 for
docs/benchmarks.md's run; every other one streamed, ``max_tokens`` 1 to 32, each prompt tagged
``[req N]``) goes to the front's ``/v1/chat/completions`` from ``CLIENTS`` threads. When
``KILL_AFTER`` (a fifth) are answered, host A gets SIGKILL and is started again at once. The last
``HELD`` (a fifth) wait until it is back (ready, its model loaded, and a health probe of the
front's passed), so that the burst can show it rejoining.

What must hold: every request answered exactly once (one answer delivered by the front; one
completion logged by the hosts, or two where host A finished it as it died and the answer died
with it); a request whose host died before its first byte retried elsewhere by the
front's Router; a stream cut mid-way ends with an error (an error chunk or a broken connection),
never as a short stream that looks finished, and the client sends it again; no call of the
front's to host A started later than one health-check interval after the kill; and host A's new
process serving requests of the burst. The counts and latencies are printed (docs/benchmarks.md).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import proxy_process
import pytest
import redis
import yaml

pytestmark = pytest.mark.deployment

EXAMPLES = proxy_process.REPO / "examples" / "deployment"
HOSTS = ("A", "B", "C")
# 60: every client thread has a request in flight at the kill (60 - HELD - KILL_AFTER = 36 of them
# are sent before the hold, more than CLIENTS), and hosts B and C have requests to serve while host
# A restarts (what the checks need); more only lengthen the burst.
REQUESTS = int(os.environ.get("FLM_BURST_REQUESTS", "60"))
CLIENTS = 24
KILL_AFTER = REQUESTS // 5  # answered requests before host A is killed
HELD = REQUESTS // 5        # the last requests of the burst, sent once host A is back
MAX_SENDS = 4         # a request cut mid-stream is sent again, at most this many times in all
REQUEST_S = 300
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a library", "rain", "a bicycle", "tea", "winter", "a river"]


@dataclass
class Outcome:
    """What the client saw of one request: how each send ended, and the final answer."""

    index: int
    stream: bool
    max_tokens: int
    sends: list[str] = field(default_factory=list)  # per send: "answered", "error chunk", "broken", "HTTP nnn"
    errors: list[str] = field(default_factory=list)  # the message of each error chunk
    finish_reason: str | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None  # from the first send to the answer


def _config_with_callback(source: Path, dest: Path) -> Path:
    """``source`` as shipped, plus ``litellm_settings.callbacks: [served_log.handler]``."""
    config = yaml.safe_load(source.read_text())
    config.setdefault("litellm_settings", {})["callbacks"] = ["served_log.handler"]
    dest.write_text(yaml.safe_dump(config))
    return dest


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    """A Redis server on a free port of 127.0.0.1 that saves nothing; its port."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (.ci/run installs Debian's redis-server)")
    port = proxy_process.free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _ask(http: httpx.Client, url: str, key: str, outcome: Outcome) -> None:
    """Send the request once; record how it ended in ``outcome.sends`` (and the answer's finish
    reason and completion tokens when answered)."""
    body = {"model": "smollm2", "temperature": 0, "max_tokens": outcome.max_tokens,
            "messages": [{"role": "user", "content": f"[req {outcome.index}] Write one sentence about "
                                                     f"{TOPICS[outcome.index % len(TOPICS)]}."}]}
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if outcome.stream:
            _ask_streamed(http, url, dict(body, stream=True, stream_options={"include_usage": True}), headers,
                          outcome)
            return
        r = http.post(url, json=body, headers=headers)
    except httpx.TransportError:
        outcome.sends.append("broken")
        return
    if r.status_code != 200:
        outcome.sends.append(f"HTTP {r.status_code}")
        return
    answer = r.json()
    outcome.finish_reason = answer["choices"][0]["finish_reason"]
    outcome.completion_tokens = answer["usage"]["completion_tokens"]
    outcome.sends.append("answered")


def _ask_streamed(http: httpx.Client, url: str, body: dict, headers: dict, outcome: Outcome) -> None:
    """``_ask`` for a stream: answered only with a finish reason, the usage chunk and ``[DONE]``."""
    finish, usage, done = None, None, False
    with http.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            outcome.sends.append(f"HTTP {r.status_code}")
            return
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                outcome.sends.append("error chunk")
                outcome.errors.append(str(chunk["error"].get("message"))[:200])
                return
            finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), finish)
            usage = chunk.get("usage") or usage
    if not (done and finish and usage):  # ended as if complete, but short: the failure the test exists for
        outcome.sends.append("short")
        return
    outcome.finish_reason, outcome.completion_tokens = finish, usage["completion_tokens"]
    outcome.sends.append("answered")


def _served(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _wait_for_a_healthy_probe(log: Path, api_base: str, since: float) -> None:
    """Until the front's log has a health probe of ``api_base`` that started after ``since`` and
    passed, then a second for the front to end that round and mark the host healthy. (A fixed
    sleep of one interval assumed a round of probes ends within it, which a loaded machine does
    not promise.)"""
    deadline = time.monotonic() + REQUEST_S
    while not any(e["marker"] is None and e["api_base"] == api_base and e["event"] == "ok" and e["start"] >= since
                  for e in _served(log)):
        assert time.monotonic() < deadline, f"no health probe of {api_base} passed since it came back"
        time.sleep(0.2)
    time.sleep(1)


def test_a_host_killed_mid_burst_costs_no_request(smollm2_gguf, redis_port, tmp_path):
    t_start = time.monotonic()
    front_config = yaml.safe_load((EXAMPLES / "front.yaml").read_text())
    interval = front_config["general_settings"]["health_check_interval"]
    host_config = _config_with_callback(EXAMPLES / "host.yaml", tmp_path / "host.yaml")
    front_config_path = _config_with_callback(EXAMPLES / "front.yaml", tmp_path / "front.yaml")
    hosts_key, front_key = f"sk-{secrets.token_hex(16)}", f"sk-{secrets.token_hex(16)}"
    here = str(Path(__file__).parent)  # served_log.py, for the proxies' callbacks
    base_env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True",
                    PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))
    # Three hosts share this machine's CPUs: one kernel thread each; the default weights, as a host runs.
    host_env = dict(base_env, LITELLM_MASTER_KEY=hosts_key, FLM_WEIGHTS="auto", FLM_THREADS="1")
    ports = {name: proxy_process.free_port() for name in HOSTS}
    front_port = proxy_process.free_port()
    api_base = {name: f"http://127.0.0.1:{ports[name]}/v1" for name in HOSTS}
    front_env = dict(base_env, LITELLM_MASTER_KEY=front_key, HOSTS_API_KEY=hosts_key, REDIS_HOST="127.0.0.1",
                     REDIS_PORT=str(redis_port), SERVED_LOG=str(tmp_path / "served-front.jsonl"),
                     **{f"HOST_{name}_API_BASE": api_base[name] for name in HOSTS})

    def start_host(name: str, life: int) -> subprocess.Popen:
        env = dict(host_env, SERVED_LOG=str(tmp_path / f"served-{name}{life}.jsonl"))
        return proxy_process.start(host_config, ports[name], env, tmp_path / f"host-{name}{life}.log")

    def load_model(name: str) -> None:
        """One request straight to the host: its proxy loads the model at the first one."""
        r = httpx.post(f"{api_base[name]}/chat/completions", headers={"Authorization": f"Bearer {hosts_key}"},
                       json={"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
                       timeout=REQUEST_S)
        assert r.status_code == 200, r.text

    # The compiled model step is cached on disk by its first process; this one compiles it (when
    # the cache is cold) while the hosts import, so the hosts load it instead of each compiling it.
    # A host loads the model at its first request, and the front's health probes are requests: the
    # front starts once the step is cached (at once when it already was), or four processes would
    # compile it side by side (minutes on 2 cores).
    warm = subprocess.Popen([str(Path(sys.executable).with_name("litellm-flm")), "run", "smollm2:135m", "Hi",
                             "--max-tokens", "1"], env=host_env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    procs = {name: start_host(name, 1) for name in HOSTS}
    front = restarted = None
    try:
        assert warm.wait(timeout=REQUEST_S) == 0
        front = proxy_process.start(front_config_path, front_port, front_env, tmp_path / "front.log")
        for name in HOSTS:
            proxy_process.wait_ready(procs[name], ports[name], tmp_path / f"host-{name}1.log")
        proxy_process.wait_ready(front, front_port, tmp_path / "front.log")
        for name in HOSTS:
            load_model(name)
        t_ready = time.monotonic()

        url = f"http://127.0.0.1:{front_port}/v1/chat/completions"
        outcomes = [Outcome(i, stream=i % 2 == 0, max_tokens=1 + (7 * i) % 32) for i in range(REQUESTS)]
        answered = threading.Semaphore(0)
        rejoined = threading.Event()

        def run(outcome: Outcome, http: httpx.Client) -> None:
            if outcome.index >= REQUESTS - HELD:
                assert rejoined.wait(REQUEST_S), "host A did not come back"
            t0 = time.monotonic()
            while len(outcome.sends) < MAX_SENDS and outcome.sends[-1:] != ["answered"]:
                _ask(http, url, front_key, outcome)
            outcome.latency_s = time.monotonic() - t0
            answered.release()

        with httpx.Client(timeout=REQUEST_S, limits=httpx.Limits(max_connections=CLIENTS)) as http, \
                concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            t_burst = time.monotonic()
            futures = [pool.submit(run, o, http) for o in outcomes]
            try:
                for _ in range(KILL_AFTER):
                    assert answered.acquire(timeout=REQUEST_S), "the burst stalled before the kill"
                procs["A"].send_signal(signal.SIGKILL)
                procs["A"].wait()
                t_kill = time.time()
                restarted = start_host("A", 2)
                proxy_process.wait_ready(restarted, ports["A"], tmp_path / "host-A2.log")
                t_listening = time.time()
                load_model("A")
                _wait_for_a_healthy_probe(tmp_path / "served-front.jsonl", api_base["A"], t_listening)
            finally:
                rejoined.set()  # a failure above lets the held requests go, so the pool ends
            for f in futures:
                f.result()
            t_end = time.monotonic()
    finally:
        for proc in [*procs.values(), front, restarted, warm]:
            if proc is not None:
                proxy_process.stop(proc)

    # ---- what the client saw ----
    ends = collections.Counter(end for o in outcomes for end in o.sends)
    cut = [o for o in outcomes if len(o.sends) > 1]
    unanswered = [(o.index, o.sends) for o in outcomes if o.sends[-1] != "answered"]
    latencies = sorted(o.latency_s for o in outcomes)
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    # ---- what the proxies logged ----
    front_calls = _served(tmp_path / "served-front.jsonl")
    host_ok = {process: collections.Counter(e["marker"] for e in _served(tmp_path / f"served-{process}.jsonl")
                                            if e["event"] == "ok" and e["marker"] is not None)
               for process in ("A1", "A2", "B1", "C1")}
    # A request host A finished as it died: its answer, or the answer's end, died with it.
    lost = host_ok["A1"].keys() & (host_ok["A2"] + host_ok["B1"] + host_ok["C1"]).keys()
    routed = [e for e in front_calls if e["marker"] is not None]  # not the health probes
    delivered = collections.Counter(e["marker"] for e in routed if e["event"] == "ok")
    to_dead = [e for e in routed if e["api_base"] == api_base["A"] and t_kill <= e["end"] and e["start"] < t_listening]
    host_of = {base: name for name, base in api_base.items()}
    failed_attempts = collections.Counter(f"{host_of.get(e['api_base'])} {e['error'].split(':')[0]}" for e in routed
                                          if e["event"] == "failed")

    print(f"\nstartup (4 proxies, models loaded) {t_ready - t_start:.1f} s; burst {t_end - t_burst:.1f} s; "
          f"host A down {t_listening - t_kill:.1f} s until its new process listened")
    print(f"requests {REQUESTS} ({REQUESTS // 2} streamed), clients {CLIENTS}: answered "
          f"{sum(o.sends[-1] == 'answered' for o in outcomes)}, unanswered {len(unanswered)}; sends: {dict(ends)}")
    print(f"sent again by the client (a cut stream, a failed send): {len(cut)}; answers the front delivered: "
          f"{sum(delivered.values())} for {len(delivered)} requests; finished by host A as it died, the answer "
          f"lost with it: {len(lost)}")
    print(f"latency s (first send to answer): p50 {q[49]:.2f}, p99 {q[98]:.2f}, max {latencies[-1]:.2f}")
    print(f"the cut streams' error chunks: {[m for o in cut for m in o.errors]}")
    last_start = max((e["start"] for e in to_dead), default=t_kill)
    print(f"front's failed calls (host, error): {dict(failed_attempts)}; its calls to host A while down: "
          f"{len(to_dead)}, the last one started {last_start - t_kill:.1f} s after the kill")
    print("served by each host process: " + ", ".join(f"{k} {sum(v.values())}" for k, v in host_ok.items()))

    assert unanswered == []
    assert ends["short"] == 0
    assert all(o.finish_reason in ("stop", "length") and 0 < o.completion_tokens <= o.max_tokens for o in outcomes)
    assert all(o.completion_tokens == o.max_tokens for o in outcomes if o.finish_reason == "length")
    # Each answer delivered once; each request finished once by the hosts, but for those whose
    # answer died with host A (the front's call to it failed), finished again elsewhere.
    assert delivered == collections.Counter(range(REQUESTS))
    assert sum(host_ok.values(), collections.Counter()).keys() == set(range(REQUESTS))
    assert all(count == 1 for counts in host_ok.values() for count in counts.values())
    assert (host_ok["A2"] + host_ok["B1"] + host_ok["C1"]).most_common(1)[0][1] == 1
    failed_on_a = {e["marker"] for e in routed if e["event"] == "failed" and e["api_base"] == api_base["A"]}
    assert lost <= failed_on_a
    # The dead host out of rotation within one health-check interval of the kill.
    assert all(e["start"] - t_kill <= interval for e in to_dead)
    # Its new process back in rotation: it served requests of the burst.
    assert sum(host_ok["A2"].values()) > 0
