"""Random-weight GGUFs shaped like the models people run locally, to measure speed and memory at
real sizes without downloading gigabytes.

A forward pass's cost depends on the shapes and the block types of its matrices, not on their
values, so a file of random blocks (every float16 scale a small finite value, so that no NaN or
infinity slows a float path) measures what the real file would. Each shape is a real model's
configuration with the block types llama.cpp's quantizer gives it:

- ``llama3.2-1b-q4_k_m``: Llama 3.2 1B (16 layers, width 2,048, GQA 32/8, tied 128,256-token
  vocabulary) as ``llama-quantize ... Q4_K_M`` writes it: Q4_K, with Q6_K for the tied
  embedding / output and for ``attn_v`` and ``ffn_down`` in the layers ``use_more_bits`` picks
  (the first and last eighth, and every third layer between: half of them);
- ``llama3.2-3b-q4_0``: Llama 3.2 3B (28 layers, width 3,072, GQA 24/8, tied vocabulary) as
  ``Q4_0`` writes it: Q4_0, with Q6_K for the tied embedding / output.

The rule is llama.cpp's ``llama_tensor_get_type`` (src/llama-quant.cpp) for these two types. RoPE
is left unscaled (Llama 3.2's ``rope_freqs`` factors change the tables' values, not any cost).
The tokenizer is a byte-level BPE of the full vocabulary size (256 byte tokens, a few merges,
the rest filler tokens no text reaches), enough for llama.cpp and us to load the file.

    python -m flm_bench.shaped_gguf llama3.2-1b-q4_k_m DIR   # writes DIR/llama3.2-1b-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
from tokenizers import pre_tokenizers

Q = gguf.GGMLQuantizationType

# Where each float16 scale sits in a block (d, and dmin for Q4_K): the rest of a block is codes.
_SCALE_BYTES = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}
_SCALE = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)


class LlamaShape(NamedTuple):
    """A Llama configuration and its quantization rule.

    Attributes:
        n_layers, width, ffn, heads, kv_heads, vocab: the model's sizes (``ffn`` the MLP's
            intermediate width; head dim = width / heads).
        context: ``llama.context_length`` written to the file.
        rope_theta: RoPE base.
        qtype: ``(gguf tensor name, layer index or -1, n_layers) -> block type``.
    """

    n_layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_theta: float
    qtype: Callable[[str, int, int], Q]

    def matrices(self) -> dict[str, tuple[int, int]]:
        """GGUF matrix name -> ``(rows, columns)`` (Hugging Face's ``[out, in]``), in file order;
        the embedding is tied (no ``output.weight``)."""
        head_dim = self.width // self.heads
        per_layer = {
            "attn_q": (self.width, self.width), "attn_k": (self.kv_heads * head_dim, self.width),
            "attn_v": (self.kv_heads * head_dim, self.width), "attn_output": (self.width, self.width),
            "ffn_gate": (self.ffn, self.width), "ffn_up": (self.ffn, self.width), "ffn_down": (self.width, self.ffn),
        }
        shapes = {"token_embd.weight": (self.vocab, self.width)}
        for i in range(self.n_layers):
            shapes |= {f"blk.{i}.{part}.weight": shape for part, shape in per_layer.items()}
        return shapes


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get the larger type in the ``_M`` mixes."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _q4_k_m(name: str, layer: int, n_layers: int) -> Q:
    if name == "token_embd.weight":  # tied: the output's type
        return Q.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(layer, n_layers):
        return Q.Q6_K
    return Q.Q4_K


def _q4_0(name: str, layer: int, n_layers: int) -> Q:
    return Q.Q6_K if name == "token_embd.weight" else Q.Q4_0


SHAPES = {
    "llama3.2-1b-q4_k_m": LlamaShape(n_layers=16, width=2048, ffn=8192, heads=32, kv_heads=8, vocab=128256,
                                     context=131072, rope_theta=500000.0, qtype=_q4_k_m),
    "llama3.2-3b-q4_0": LlamaShape(n_layers=28, width=3072, ffn=8192, heads=24, kv_heads=8, vocab=128256,
                                   context=131072, rope_theta=500000.0, qtype=_q4_0),
}


def random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: Q) -> np.ndarray:
    """Random ``[N, K]`` weights of block type ``qtype`` as GGUF blocks, ``[N, K / block * bytes]``
    uint8: random codes, every float16 scale (and min) 0.01 (random bits would hold NaNs).

    Raises:
        KeyError: a block type other than Q4_0, Q8_0, Q4_K, Q6_K.
    """
    n, k = shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in _SCALE_BYTES[qtype]:
        blocks[..., at:at + 2] = _SCALE
    return blocks.reshape(n, -1)


def write_shaped_gguf(directory: Path, name: str, seed: int = 0) -> Path:
    """Write ``directory / f"{name}.gguf"`` (the shape ``SHAPES[name]``, random blocks from ``seed``)
    unless it is already there; written to a temporary name and renamed, so an interrupted write
    leaves no file that looks whole.

    Returns:
        The file's path.
    Raises:
        KeyError: ``name`` is not in ``SHAPES``.
    """
    shape = SHAPES[name]
    path = Path(directory) / f"{name}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".gguf.partial")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(partial), "llama")
    _add_config(writer, shape, name)
    _add_tokenizer(writer, shape.vocab)
    ones = np.ones(shape.width, np.float32)
    writer.add_tensor("output_norm.weight", ones)
    for tensor, dims in shape.matrices().items():
        layer = int(tensor.split(".")[1]) if tensor.startswith("blk.") else -1
        qtype = shape.qtype(tensor, layer, shape.n_layers)
        writer.add_tensor(tensor, random_blocks(rng, dims, qtype), raw_dtype=qtype)
        if tensor.endswith("attn_q.weight"):
            writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
        if tensor.endswith("ffn_gate.weight"):
            writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    os.replace(partial, path)
    return path


def _add_config(writer: gguf.GGUFWriter, s: LlamaShape, name: str) -> None:
    writer.add_name(f"random weights shaped like {name}")
    writer.add_block_count(s.n_layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.width)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(s.width // s.heads)
    writer.add_vocab_size(s.vocab)


def _add_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE of ``vocab`` tokens: two specials, the 256 byte characters, the pieces of
    three merges, then filler tokens ``<|filler_i|>`` (normal tokens no merge produces)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
    tokens = ["<|begin_of_text|>", "<|eot_id|>", *alphabet, *("".join(m) for m in merges)]
    tokens += [f"<|filler_{i}|>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    writer.add_token_types([3, 3] + [1] * (vocab - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_shaped_gguf(args.directory, args.shape, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
