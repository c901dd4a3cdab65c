"""Plain decoding stands without speculation: importing the scheduling, sampling and text packages and
running a plain engine (sampled, with logprobs, penalties and a stop string) never imports
``flm_runtime.speculation``. A fresh interpreter, so that no other test's imports count."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys

    sys.path.insert(0, {fakes!r})
    from engine_fakes import FakeTokenizer, HashModel

    import flm_runtime.request, flm_runtime.sampling.grammar, flm_runtime.sampling.picker
    import flm_runtime.sampling.processors, flm_runtime.sampling.sampler
    import flm_runtime.scheduling.admission, flm_runtime.scheduling.handle, flm_runtime.scheduling.sequence
    import flm_runtime.text.detokenizer, flm_runtime.text.stop
    from flm_runtime.request import SamplingParams
    from flm_runtime.scheduling.engine import Engine

    engine = Engine(HashModel(), FakeTokenizer(vocab_size=300), name="plain")
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=True, top_logprobs=2,
                            frequency_penalty=0.5, stop=("zz",))
    done = engine.submit([1, 2, 3], params).result()
    engine.close()
    assert done.completion_tokens > 0, done
    loaded = sorted(m for m in sys.modules if m.startswith("flm_runtime.speculation"))
    assert not loaded, loaded
    print("ok")
""")


def test_plain_decoding_never_imports_speculation():
    script = SCRIPT.format(fakes=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
