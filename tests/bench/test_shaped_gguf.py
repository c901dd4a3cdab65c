"""flm_bench.shaped_gguf: the shapes are the real models' and the block types llama.cpp's quantizer
gives them; random blocks decode to finite weights. (Writing a whole shaped file, 0.8-1.8 GB, is
left to the benchmark.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from flm_bench.shaped_gguf import SHAPES, random_blocks

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize(("name", "params"), [("llama3.2-1b-q4_k_m", 1_235_814_400),
                                              ("llama3.2-3b-q4_0", 3_212_749_824)])
def test_a_shape_holds_the_real_models_parameters(name, params):
    # The parameter counts Hugging Face states for meta-llama/Llama-3.2-1B and -3B: the matrices
    # here plus the norms (two per layer and the final one, each of the width).
    shape = SHAPES[name]
    norms = (2 * shape.n_layers + 1) * shape.width
    assert sum(rows * cols for rows, cols in shape.matrices().values()) + norms == params


def test_q4_k_m_gives_half_the_v_and_down_projections_and_the_output_six_bits_as_llama_cpp():
    shape = SHAPES["llama3.2-1b-q4_k_m"]
    types = {name: shape.qtype(name, int(name.split(".")[1]) if name.startswith("blk.") else -1, shape.n_layers)
             for name in shape.matrices()}
    six_bit = sorted({int(n.split(".")[1]) for n, t in types.items() if t == Q.Q6_K and n.startswith("blk.")})
    # use_more_bits for 16 layers: the first and last 2, and every third from layer 2 on (4, 7, 10, 13).
    assert six_bit == [0, 1, 4, 7, 10, 13, 14, 15]
    assert {n.split(".")[2] for n, t in types.items() if t == Q.Q6_K and n.startswith("blk.")} == {"attn_v", "ffn_down"}
    assert types["token_embd.weight"] == Q.Q6_K
    assert {t for n, t in types.items() if t != Q.Q6_K} == {Q.Q4_K}
    q4_0 = SHAPES["llama3.2-3b-q4_0"]
    assert {q4_0.qtype(n, 0, q4_0.n_layers) for n in q4_0.matrices() if n != "token_embd.weight"} == {Q.Q4_0}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K])
def test_random_blocks_decode_to_finite_weights_of_the_shape(qtype):
    blocks = random_blocks(np.random.default_rng(0), (8, 512), qtype)
    weights = gguf.quants.dequantize(blocks, qtype)
    assert weights.shape == (8, 512) and np.isfinite(weights).all()
    assert 0 < np.abs(weights).max() < 64 * 0.01 * 64  # scales 0.01: codes times sub-scales stay small
