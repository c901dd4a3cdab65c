"""GGUF loading: tiny files written here with gguf.GGUFWriter, and the embedded SmolLM2 file."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
from tiny_llama_files import hand_permute, random_hf_weights, tiny_config, write_tiny_gguf

from flm_runtime.errors import InvalidRequestError, ModelFormatError
from flm_runtime.families.llama import FAMILY as LLAMA
from flm_runtime.kernels.quant import QuantWeight
from flm_runtime.loading import converted
from flm_runtime.loading import gguf as gguf_loader
from flm_runtime.loading.gguf import load_gguf, open_gguf, permute_rope, unpermute_rope
from flm_runtime.loading.weights import weight_kind

Q = gguf.GGMLQuantizationType


def test_tiny_f32_round_trip_undoes_qk_permutation(tmp_path):
    config = tiny_config()
    weights = random_hf_weights(config)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", config, weights)

    model = load_gguf(path)

    assert model.config == config
    assert set(model.weights) == set(weights)
    for name, w in weights.items():
        got = model.weights[name]
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable, name
        np.testing.assert_array_equal(got, w, err_msg=name)


def test_raw_mode_keeps_llama_cpp_order(tmp_path):
    config = tiny_config()
    weights = random_hf_weights(config)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", config, weights)

    raw = load_gguf(path, unpermute_qk=False).weights

    q, k = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    np.testing.assert_array_equal(raw[q], hand_permute(weights[q], config.num_attention_heads))
    np.testing.assert_array_equal(raw[k], hand_permute(weights[k], config.num_key_value_heads))
    assert not np.array_equal(raw[q], weights[q])


@pytest.mark.parametrize("n_head,d", [(1, 2), (3, 8), (2, 64)])
def test_permute_helpers_match_hand_permutation(n_head, d):
    w = np.random.default_rng(1).standard_normal((n_head * d, 5)).astype(np.float32)
    np.testing.assert_array_equal(permute_rope(w, n_head), hand_permute(w, n_head))
    np.testing.assert_array_equal(unpermute_rope(hand_permute(w, n_head), n_head), w)


def _rope_half(x, pos, theta=10000.0):
    """HF rotate-half RoPE on [D] (pairs i, i+D/2)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(d // 2) / (d // 2))
    x1, x2 = x[: d // 2], x[d // 2:]
    cos, sin = np.cos(ang), np.sin(ang)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


def _rope_interleaved(x, pos, theta=10000.0):
    """llama.cpp normal RoPE on [D] (pairs 2i, 2i+1)."""
    d = x.shape[-1]
    ang = pos * theta ** (-np.arange(d // 2) / (d // 2))
    a, b = x[0::2], x[1::2]
    out = np.empty_like(x)
    out[0::2], out[1::2] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
    return out


def test_unpermuted_weights_give_the_same_attention_scores_under_rotate_half():
    # The point of the permutation: llama.cpp's interleaved RoPE on stored weights must give the
    # same q.k score as HF's rotate-half RoPE on un-permuted weights (float64 to compare tightly).
    rng = np.random.default_rng(2)
    d, hidden = 16, 12
    wq, wk = rng.standard_normal((d, hidden)), rng.standard_normal((d, hidden))
    xm, xn = rng.standard_normal(hidden), rng.standard_normal(hidden)
    gq, gk = permute_rope(wq, 1), permute_rope(wk, 1)  # as stored in GGUF
    llama_cpp = _rope_interleaved(gq @ xm, 7) @ _rope_interleaved(gk @ xn, 3)
    hf = _rope_half(unpermute_rope(gq, 1) @ xm, 7) @ _rope_half(unpermute_rope(gk, 1) @ xn, 3)
    wrong = _rope_half(gq @ xm, 7) @ _rope_half(gk @ xn, 3)
    assert hf == pytest.approx(llama_cpp, rel=1e-12)
    assert wrong != pytest.approx(llama_cpp, rel=1e-3)


@pytest.mark.parametrize("qtype,tol", [(Q.F16, 1e-2), (Q.BF16, 2e-2), (Q.Q8_0, 0.05),
                                       (Q.Q4_0, 0.5), (Q.Q4_1, 0.5)])
def test_quantized_matrices_dequantize_to_the_right_shape_and_values(tmp_path, qtype, tol):
    config = tiny_config(tie_word_embeddings=False)
    weights = random_hf_weights(config)
    path = write_tiny_gguf(tmp_path / "q.gguf", config, weights, qtype=qtype)

    got = load_gguf(path).weights

    assert "lm_head.weight" in got
    for name, shape in LLAMA.checkpoint_shapes(config).items():
        assert got[name].shape == shape and got[name].dtype == np.float32, name
        # Quantization error is per block; un-permuted rows line up with the originals.
        assert np.abs(got[name] - weights[name]).max() < tol * np.abs(weights[name]).max(), name


def test_unsupported_quantization_names_tensor_and_type(tmp_path):
    config = tiny_config()
    # Q8_1 has no numpy dequantizer in gguf-py: 32 values per 40-byte block.
    q8_1 = np.zeros((64, 2 * 40), dtype=np.uint8)
    path = write_tiny_gguf(tmp_path / "bad.gguf", config, random_hf_weights(config),
                           replace={"blk.0.attn_q.weight": (q8_1, Q.Q8_1)})
    with pytest.raises(ModelFormatError, match=r"blk\.0\.attn_q\.weight.*Q8_1"):
        load_gguf(path)


def test_an_unknown_weight_kind_is_a_bad_request_naming_its_origin(monkeypatch):
    """A bad ``$FLM_WEIGHTS`` is the user's to fix (LiteLLM: a 400, not a retried connection error)."""
    monkeypatch.setenv("FLM_WEIGHTS", "q3")
    with pytest.raises(InvalidRequestError, match="FLM_WEIGHTS='q3' is not a weight kind; use one of auto, q4, q8, "
                                                  "f32") as e:
        weight_kind()
    assert e.value.param == "FLM_WEIGHTS"
    with pytest.raises(InvalidRequestError, match="weights='q5'") as e:
        weight_kind("q5")
    assert e.value.param == "weights"
    assert weight_kind(" Q8 ") == "q8"


def test_other_architecture_is_rejected(tmp_path):
    config = tiny_config()
    path = write_tiny_gguf(tmp_path / "q.gguf", config, random_hf_weights(config), arch="falcon")
    with pytest.raises(ModelFormatError, match="architecture 'falcon' is not supported"):
        load_gguf(path)


def test_unknown_tensor_is_rejected(tmp_path):
    config = tiny_config()
    extra = {"blk.0.attn_q.bias": (np.ones(64, np.float32), Q.F32)}
    path = write_tiny_gguf(tmp_path / "r.gguf", config, random_hf_weights(config),
                           extra_tensors=extra)
    with pytest.raises(ModelFormatError, match="GGUF tensor 'blk.0.attn_q.bias' is not supported by the llama family"):
        load_gguf(path)


def test_missing_and_garbage_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFormatError, match="garbage.gguf"):
        load_gguf(garbage)


def _assert_reads_as_gguf_py(path):
    """``open_gguf`` gives what gguf-py's own reader gives: every key, value and value type, and
    every tensor's name, type, shape and bytes."""
    ours, ref = open_gguf(path), gguf.GGUFReader(path, "r")
    expected = {name: f.contents() for name, f in ref.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        got = ours.metadata[key]
        assert got == value and type(got) is type(value), key
        assert [type(v) for v in got] == [type(v) for v in value] if isinstance(value, list) else True, key
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == \
        [(t.name, t.tensor_type, tuple(t.shape.tolist())) for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors, strict=True):
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape and not t.data.flags.writeable, t.name
        np.testing.assert_array_equal(t.data, r.data, err_msg=t.name)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1])
def test_header_and_tensors_read_as_gguf_py_reads_them(tmp_path, qtype):
    config = tiny_config()
    extra_kv = {"test.u8": (7, gguf.GGUFValueType.UINT8), "test.i64": (-3, gguf.GGUFValueType.INT64),
                "test.f64": (0.1, gguf.GGUFValueType.FLOAT64), "test.flag": (True, gguf.GGUFValueType.BOOL),
                "test.text": ("é ü ☃", gguf.GGUFValueType.STRING),
                "test.floats": ([0.5, -1.25], gguf.GGUFValueType.ARRAY),
                "test.flags": ([True, False], gguf.GGUFValueType.ARRAY),
                "general.alignment": (64, gguf.GGUFValueType.UINT32)}
    path = write_tiny_gguf(tmp_path / "t.gguf", config, random_hf_weights(config), qtype=qtype, extra_kv=extra_kv)
    _assert_reads_as_gguf_py(path)
    assert open_gguf(path).metadata["test.text"] == "é ü ☃"


def test_smollm2_reads_as_gguf_py_reads_it(smollm2_gguf):
    _assert_reads_as_gguf_py(smollm2_gguf)


def test_truncated_and_big_endian_files_are_refused(tmp_path):
    config = tiny_config()
    data = write_tiny_gguf(tmp_path / "t.gguf", config, random_hf_weights(config)).read_bytes()
    for cut in (6, 30, 200, len(data) - 8):  # in the header, a key, the tensor table, the last tensor
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError, match=f"short{cut}.gguf"):
            open_gguf(short)
    swapped = tmp_path / "big.gguf"
    swapped.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(ModelFormatError, match="big-endian"):
        open_gguf(swapped)


def _arrays(weights):
    """name -> the arrays of each weight (a quantized one's codes, scales and mins)."""
    return {name: (w.codes, w.scales, w.mins) if isinstance(w, QuantWeight) else (w,) for name, w in weights.items()}


def _same_bytes(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(_arrays(a)[name], _arrays(b)[name], strict=True):
            assert (x is None and y is None) or (x.dtype == y.dtype and x.shape == y.shape
                                                 and x.tobytes() == y.tobytes()), name


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.F16])
def test_kept_weights_map_back_bit_for_bit_until_their_file_changes(tmp_path, monkeypatch, qtype):
    config = tiny_config()
    path = write_tiny_gguf(tmp_path / "q.gguf", config, random_hf_weights(config), qtype=qtype)
    keep = tmp_path / "kept"
    fresh = load_gguf(path, weights="auto").weights
    _same_bytes(load_gguf(path, weights="auto", keep=keep).weights, fresh)  # converted, then kept
    assert [p.name for p in keep.iterdir()] == [converted.cache_file(keep, path, "auto").name]

    conversions = []
    convert = gguf_loader.load_gguf_weights
    monkeypatch.setattr(gguf_loader, "load_gguf_weights", lambda *a, **k: conversions.append(1) or convert(*a, **k))
    kept = load_gguf(path, weights="auto", keep=keep).weights
    _same_bytes(kept, fresh)
    assert not conversions and all(a.flags.writeable for arrays in _arrays(kept).values() for a in arrays
                                   if a is not None)  # numba types read-only arrays apart
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the source changed: converted again
    _same_bytes(load_gguf(path, weights="auto", keep=keep).weights, fresh)
    assert len(conversions) == 1
    load_gguf(path, weights="q8", keep=keep)  # another kind, another file
    load_gguf(path, weights="f32", keep=keep)  # float32 is not kept (four times the file)
    assert len(conversions) == 3 and len(list(keep.iterdir())) == 2


def test_a_damaged_or_unwritable_keep_costs_only_a_conversion(tmp_path):
    config = tiny_config()
    path = write_tiny_gguf(tmp_path / "q.gguf", config, random_hf_weights(config), qtype=Q.Q4_1)
    fresh = load_gguf(path, weights="auto").weights
    keep = tmp_path / "kept"
    load_gguf(path, weights="auto", keep=keep)
    kept = converted.cache_file(keep, path, "auto")
    data = kept.read_bytes()
    for damaged in (data[:len(data) // 2], b"not a kept file", data[:-64]):
        kept.write_bytes(damaged)
        _same_bytes(load_gguf(path, weights="auto", keep=keep).weights, fresh)
        assert kept.read_bytes() == data  # replaced whole
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the directory would be")
    _same_bytes(load_gguf(path, weights="auto", keep=blocked).weights, fresh)
    assert list(tmp_path.glob("**/.*.part")) == []  # no temporary file left behind (files.written_whole's name)


def test_smollm2_config_matches_design_facts(smollm2_bundle):
    c = smollm2_bundle.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (
        30, 576, 9, 3, 64, 1536, 49152, 8192)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5 and c.tie_word_embeddings


def test_smollm2_weights_are_complete_float32_hf_layout(smollm2_bundle):
    weights = smollm2_bundle.weights
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    # ~540 MB: docs/design.md, "The embedded model"
    assert sum(w.nbytes for w in weights.values()) == 538_060_032
    assert all(np.isfinite(w).all() for w in weights.values())
