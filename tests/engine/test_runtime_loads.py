"""``Runtime.get_engine`` while another tag loads: a served engine answers at once, and concurrent
first requests for the loading tag get one engine, built once."""

from __future__ import annotations

import threading
import time

from flm_runtime import api
from flm_runtime.settings import Settings
from flm_runtime.speculation import decoders

SLOW = "smollm2-dflash:135m"  # its build (the draft's load) is made to take LOAD_S
LOAD_S = 3.0


def test_a_load_never_blocks_an_engine_already_served(monkeypatch):
    builds = []

    def slow_decoder(tag, *args):
        if tag == SLOW:
            builds.append(tag)
            time.sleep(LOAD_S)
        return decoders.decoder_for(tag, *args)

    monkeypatch.setattr(api, "decoder_for", slow_decoder)
    runtime = api.Runtime(Settings(host_costs="0"))
    try:
        served = runtime.get_engine("smollm2:135m", "cpu")
        got: list = []
        loaders = [threading.Thread(target=lambda: got.append(runtime.get_engine(SLOW, "cpu"))) for _ in range(2)]
        for t in loaders:
            t.start()
        time.sleep(0.5)  # both loaders are in the build
        t0 = time.perf_counter()
        assert runtime.get_engine("smollm2:135m", "cpu") is served
        waited = time.perf_counter() - t0
        for t in loaders:
            t.join()
    finally:
        runtime.close()
    assert waited < LOAD_S / 3, f"a served engine waited {waited:.2f} s on another tag's load"
    assert builds == [SLOW] and len(got) == 2 and got[0] is got[1] and got[0].name == SLOW
