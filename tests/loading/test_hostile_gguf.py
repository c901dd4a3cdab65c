"""Hostile GGUF files (issue #33, item 6): each file ``gguf_mutations`` makes from the tiny GGUF the
tests build (float32 and Q8_0 matrices) is refused with ``ModelFormatError`` naming the file,
within a second, allocating no more than the file's size (and the Python objects of its header)."""

from __future__ import annotations

import gc
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
from gguf_mutations import hostile_files
from tiny_llama_files import random_hf_weights, tiny_config, write_tiny_gguf

from flm_runtime.errors import ModelFormatError
from flm_runtime.loading import load_model_files
from flm_runtime.loading.gguf import open_gguf

BASES = {"f32": gguf.GGMLQuantizationType.F32, "q8_0": gguf.GGMLQuantizationType.Q8_0}
# How far the interpreter's own caches move a traced peak between two loads of the same file (up to
# about 900 bytes measured, depending on the tests run before): a refusal in the last tensors
# reaches the intact load's peak (the tensors before it), so it is compared with that peak plus this.
PEAK_NOISE = 4096


def _base_files() -> dict[str, bytes]:
    """The tiny GGUF's bytes with each kind of matrix of ``BASES``."""
    config, weights = tiny_config(), random_hf_weights(tiny_config())
    with tempfile.TemporaryDirectory() as d:
        return {tag: write_tiny_gguf(Path(d) / f"{tag}.gguf", config, weights, qtype=qtype).read_bytes()
                for tag, qtype in BASES.items()}


def _distinct_cases() -> list:
    """Every base file's hostile files, each distinct file once (the bases' headers agree up to
    their tensor types: cutting them there gives the same bytes)."""
    cases: dict[bytes, object] = {}
    for tag, data in BASE_FILES.items():
        for case in hostile_files(data, tag):
            cases.setdefault(case.data, case)
    return list(cases.values())


BASE_FILES = _base_files()
CASES = _distinct_cases()


def _traced(call: Callable[[], object]) -> tuple[BaseException | None, float, int]:
    """What ``call()`` raised (None: nothing), how long it took (seconds) and the peak of what it
    allocated (bytes; numpy's buffers included: tracemalloc sees them)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - the test says which type it must be
        error = e
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return error, seconds, peak


@pytest.fixture(scope="module")
def intact_peaks(tmp_path_factory) -> dict[str, tuple[int, int]]:
    """Each base file loads (so a refusal is its mutation's doing); what reading its header and
    loading it allocate at their peaks (bytes)."""
    gc.collect()  # what earlier tests left (a closed engine's cycles) is freed now, not inside a measurement
    peaks = {}
    for tag, data in BASE_FILES.items():
        path = tmp_path_factory.mktemp("intact") / f"{tag}.gguf"
        path.write_bytes(data)
        error, _, header = _traced(lambda: open_gguf(path))
        assert error is None, f"{tag}: {error!r}"
        error, _, load = _traced(lambda: load_model_files(path, weights="auto"))
        assert error is None, f"{tag}: {error!r}"
        peaks[tag] = header, load
    return peaks


def test_the_generator_makes_over_200_distinct_hostile_files():
    assert len(CASES) >= 200
    assert len({c.id for c in CASES}) == len(CASES)
    assert not any(c.data in BASE_FILES.values() for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_hostile_gguf_is_refused_promptly_naming_the_file(case, tmp_path, intact_peaks):
    """A typed error naming the file, within a second (the bound against a hang, not a speed
    figure), and no allocation sized by a hostile count or length: at most the file's size plus
    what the intact header's Python objects take (a token string of 1 byte in the file is a
    Python object of about 50). A non-finite weight shows only when its tensor is converted:
    that refusal is bounded by what loading the intact file allocates (the tensors converted
    before it, one tensor's temporaries)."""
    path = tmp_path / "hostile.gguf"
    path.write_bytes(case.data)
    error, seconds, peak = _traced(lambda: load_model_files(path, weights="auto"))
    assert isinstance(error, ModelFormatError), repr(error)
    assert str(path) in str(error)
    assert seconds < 1.0
    header, load = intact_peaks[case.id.split("-")[0]]
    assert peak < (load + PEAK_NOISE if case.in_conversion else len(case.data) + header)
