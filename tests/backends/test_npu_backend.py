"""The npu backend's host side against the cpu backend, through a fake ``pyxrt`` whose kernels are
the numpy reference of each manifest role. This checks the buffer layouts, argument order, syncs,
runlists and KV handling of ``NpuModel``; it does not check any real kernel or device (there is
none here): what it shows is that a kernel build meeting the manifest would give the cpu
backend's results through this host code."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flm_runtime.backends import TargetModel, decode, forward, npu, prefill, prefill_chunks
from flm_runtime.backends.npu import NpuModel
from flm_runtime.backends.npu.layout import from_bf16, to_bf16
from flm_runtime.kv_cache import KVCache
from flm_runtime.errors import BackendUnavailableError
from flm_runtime.scheduling.engine import Engine
from flm_runtime.speculation.speculative import SpeculativeDecoder

from npu_fixtures import TAG, ByteTokenizer, fake_pyxrt_for, random_draft, tiny_model, write_tiny_build

PROMPT = np.array([5, 17, 42, 3, 88, 61, 7, 7, 30, 2, 95, 14, 50])  # 13 tokens: chunks of 8 + 5


@pytest.fixture(autouse=True)
def fresh_device():
    npu.close_device()
    yield
    npu.close_device()


@pytest.fixture
def bf16_kv(monkeypatch):
    """The cpu backend storing K/V rounded to bfloat16, as the manifest's KV buffer does: the
    reference that isolates the npu host code (the weights are on the bf16 grid already)."""
    write = KVCache.write

    def rounded(self, layer, k, v):
        write(self, layer, from_bf16(to_bf16(k)), from_bf16(to_bf16(v)))

    monkeypatch.setattr(KVCache, "write", rounded)


def agree(npu_logits: np.ndarray, cpu_logits: np.ndarray) -> None:
    """Same top-1, same logits up to float32 summation order (which can flip a bf16 rounding of K/V)."""
    a, b = npu_logits.reshape(-1, npu_logits.shape[-1]), cpu_logits.reshape(-1, cpu_logits.shape[-1])
    assert np.array_equal(a.argmax(-1), b.argmax(-1))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * np.abs(b).max())


def build(tmp_path, *, max_positions: int = 128, same_xclbin: bool = False, **fake):
    cpu = tiny_model(max_positions=max_positions)
    manifest = write_tiny_build(tmp_path, cpu, same_xclbin=same_xclbin)
    pyxrt = fake_pyxrt_for(manifest, cpu, **fake)
    return cpu, NpuModel(cpu, manifest, manifest.build_for(TAG), pyxrt=pyxrt), pyxrt


@pytest.mark.parametrize("same_xclbin", [False, True])
def test_prefill_verify_and_decode_match_the_cpu_backend(tmp_path, same_xclbin, bf16_kv):
    cpu, model, _ = build(tmp_path, same_xclbin=same_xclbin)
    assert isinstance(model, TargetModel) and isinstance(cpu, TargetModel)
    ref = forward(cpu, PROMPT, cpu.new_cache(), all_logits=True, taps=(0, 2))  # [13, V], [13, 2E]

    cache = model.new_cache()
    out = forward(model, PROMPT, cache, all_logits=True, taps=(0, 2))
    agree(out.logits, ref.logits)
    np.testing.assert_allclose(out.taps, ref.taps, rtol=0, atol=1e-4 * np.abs(ref.taps).max())
    assert cache.length == 13

    cache.trim(5)  # roll back 8 positions (a rejected block), then decode them one by one
    for j, token in enumerate(PROMPT[5:]):
        agree(decode(model, int(token), cache).logits, ref.logits[5 + j])
    assert cache.length == 13
    agree(prefill(model, PROMPT, model.new_cache()).logits, ref.logits[-1])
    chunks = list(prefill_chunks(model, PROMPT, model.new_cache(), taps=(1,)))
    assert [c.taps.shape[0] for c in chunks] == [8, 5]

    caches = [model.new_cache(), model.new_cache()]  # an engine step: a decode row beside a prompt chunk
    prefill(model, PROMPT[:4], caches[0])
    out = model.forward_batch([PROMPT[4:5], PROMPT[:3]], caches, taps=(1,), logit_rows=[1, 1])
    agree(out.logits, np.stack([ref.logits[4], ref.logits[2]]))
    assert out.taps.shape[0] == 4 and [c.length for c in caches] == [5, 3]


def test_accuracy_against_the_float32_cpu_backend(tmp_path):
    """Against the plain cpu backend (float32 KV) the bf16 KV buffer costs a little: measured as the
    reference benchmark measures agreement, by logit cosine and top-1 agreement (except at near-ties of the cpu logits)."""
    cpu, model, _ = build(tmp_path)
    a = forward(model, PROMPT, model.new_cache(), all_logits=True).logits
    b = forward(cpu, PROMPT, cpu.new_cache(), all_logits=True).logits
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert cos.min() > 0.999, cos
    top2 = np.sort(b, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.05  # margins above the bf16 error of this random model
    assert clear.sum() >= 10 and np.array_equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_dflash_on_the_npu_target_equals_plain_greedy(tmp_path):
    """The speculative step (taps, 8-position verify, trim) on an NpuModel: greedy output equals
    the same target's plain greedy output (docs/design.md, "Contract", 1), with a random draft."""
    _, model, _ = build(tmp_path)
    outputs = []
    for speculative in (None, SpeculativeDecoder(model, random_draft(model))):
        engine = Engine(model, ByteTokenizer(), name="tiny", speculative=speculative)
        try:
            params = engine.sampling_params(temperature=0.0, max_tokens=24, ignore_eos=True)
            done = engine.submit(PROMPT[:11], params).result(timeout=60)
        finally:
            engine.close()
        outputs.append(list(done.token_ids))
    assert outputs[0] == outputs[1]
    assert done.stats.spec.steps >= 3 and done.stats.spec.drafted == 7 * done.stats.spec.steps


def test_runlists_buffers_and_syncs(tmp_path):
    cpu, model, pyxrt = build(tmp_path, same_xclbin=True)
    layers = cpu.config.num_hidden_layers
    bos = [e for e in pyxrt.log if e[0] == "bo"]
    assert ("bo", 16 * 4, "cacheable", 1) in bos  # the instruction words, group_id(1)
    assert {e[2] for e in bos if e[3] != 1} == {"host_only"}  # data on group_id(3 + i)
    assert {e[3] for e in bos if e[3] != 1} <= {103, 104, 105, 106, 107}
    pyxrt.log.clear()
    decode(model, 5, model.new_cache())
    runs = [e for e in pyxrt.log if e[0] in ("runlist", "run")]
    assert runs[0] == ("runlist", layers + 1)  # one runlist: every layer, then the LM head
    assert [e[1] for e in runs[1:]] == ["flm_decode_layer"] * layers + ["flm_lm_head"]
    syncs = [e for e in pyxrt.log if e[0] == "sync"]
    assert syncs[0][1] == "XCL_BO_SYNC_BO_TO_DEVICE" and syncs[-1][1] == "XCL_BO_SYNC_BO_FROM_DEVICE"


def test_separate_xclbins_and_no_runlist_binding(tmp_path, bf16_kv):
    """Layer and head in different xclbins (two hardware contexts), and a pyxrt without
    ``runlist``: start + wait per run, same results."""
    cpu, model, pyxrt = build(tmp_path, runlist=False)
    pyxrt.log.clear()
    ref = forward(cpu, PROMPT[:8], cpu.new_cache(), all_logits=True).logits
    agree(forward(model, PROMPT[:8], model.new_cache(), all_logits=True).logits, ref)
    assert not [e for e in pyxrt.log if e[0] == "runlist"]
    assert len([e for e in pyxrt.log if e[0] == "hw_context"]) == 0  # contexts were made at load


def test_kv_cache_grows_and_keeps_its_positions(tmp_path, bf16_kv):
    cpu, model, _ = build(tmp_path, max_positions=600)
    ids = np.random.default_rng(1).integers(0, cpu.config.vocab_size, 300)
    cache = model.new_cache(1)
    assert cache.buffer_capacity == 256
    prefill(model, ids[:250], cache)
    logits = forward(model, ids[250:], cache, all_logits=True).logits  # grows to 512 mid-way
    assert cache.buffer_capacity == 512 and cache.length == 300
    agree(logits, forward(cpu, ids, cpu.new_cache(), all_logits=True).logits[250:])


def test_geometry_mismatch_is_refused(tmp_path):
    cpu = tiny_model()
    manifest = write_tiny_build(tmp_path, cpu)
    other = tiny_model(max_positions=256)
    with pytest.raises(BackendUnavailableError,
                       match=r"does not fit this model: max_positions: build 128, model 256"):
        NpuModel(other, manifest, manifest.build_for(TAG), pyxrt=fake_pyxrt_for(manifest, cpu))


def test_pyxrt_errors_become_backend_errors(tmp_path):
    cpu = tiny_model()
    manifest = write_tiny_build(tmp_path, cpu)
    model = NpuModel(cpu, manifest, manifest.build_for(TAG),
                     pyxrt=fake_pyxrt_for(manifest, cpu, fail="flm_verify_layer"))
    with pytest.raises(BackendUnavailableError, match=r"NPU: running verify_layer x3 \+ lm_head at positions "
                                                      r"0\.\.7 failed: RuntimeError: Command failed"):
        forward(model, PROMPT[:8], model.new_cache(), all_logits=True)
    with pytest.raises(BackendUnavailableError, match=r"no NPU device: pyxrt.device\(0\) failed: No such "
                                                      r"device with index '0' \(sysfs: "):
        npu.close_device()
        NpuModel(cpu, manifest, manifest.build_for(TAG), pyxrt=fake_pyxrt_for(manifest, cpu, devices=0))
    bad = write_tiny_build(tmp_path / "bad", cpu)
    files = bad.build_for(TAG).kernels  # a kernel name the xclbin does not have (unvalidated build)
    files["lm_head"] = dataclasses.replace(files["lm_head"], kernel="nope")
    npu.close_device()
    with pytest.raises(BackendUnavailableError, match=r"creating kernel 'nope' of lm_head.xclbin \(lm_head\) "
                                                      r"failed: RuntimeError: No such kernel 'nope'"):
        NpuModel(cpu, bad, bad.build_for(TAG), pyxrt=fake_pyxrt_for(bad, cpu))


def test_the_npu_reference_layer_is_the_runtime_layer():
    """``npu.reference.decoder_layer`` (the kernels' contract) against the runtime's decoder layer
    (``layers.decoder``) on the same weights and rows, a prefill then a decode step: equal within
    the bfloat16 rounding of the reference's keys and values."""
    from flm_runtime.backends.npu import reference
    from flm_runtime.kernels import cpu
    from flm_runtime.layers.decoder import DecoderLayer, LayerWeights, RowSpan
    from flm_runtime.layers.spec import LayerSpec

    e, f, h, hkv, d, s = 48, 80, 4, 2, 12, 32
    rng = np.random.default_rng(5)
    w = {"attn_norm": 1 + 0.2 * rng.standard_normal(e), "wqkv": rng.standard_normal(((h + 2 * hkv) * d, e)) / 7,
         "wo": rng.standard_normal((e, h * d)) / 7, "ffn_norm": 1 + 0.2 * rng.standard_normal(e),
         "w_gate_up": rng.standard_normal((2 * f, e)) / 7, "w_down": rng.standard_normal((e, f)) / 9}
    w = {k: v.astype(np.float32) for k, v in w.items()}
    geometry = {"H": h, "Hkv": hkv, "D": d, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    spec = LayerSpec(hidden_size=e, ffn_size=f, n_heads=h, n_kv_heads=hkv, head_dim=d, rms_norm_eps=1e-5,
                     rope_theta=10000.0)
    decoder = DecoderLayer(LayerWeights(**w), spec)
    cache = KVCache.private(1, hkv, d, s)
    cos, sin = cpu.rope_tables(d, s, spec.rope_theta)
    kv = np.zeros((2, hkv, s, d), dtype=np.uint16)
    for start, t in ((0, 6), (6, 1)):
        x = rng.standard_normal((8, e)).astype(np.float32)  # the activation buffer: rows 0..T-1 are the step's
        got = np.zeros_like(x)
        reference.decoder_layer(x, got, w, kv, np.array([start, t, s, 0], dtype=np.int32), geometry)
        cache.reserve(t)
        want = decoder(0, x[:t], [RowSpan(cache, start, slice(0, t), 0)], cos[start:start + t], sin[start:start + t])
        cache.commit(t)
        np.testing.assert_allclose(got[:t], want, rtol=0, atol=2e-2 * np.abs(want).max())
        np.testing.assert_array_equal(to_bf16(cache.keys(0)), kv[0, :, :start + t])  # the same keys, rounded
