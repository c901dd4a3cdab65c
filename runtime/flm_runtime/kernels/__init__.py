"""The cpu's kernels, apart from how a model composes them (``flm_runtime.layers``), as
ggml-cpu keeps its ops apart from its graphs.

- ``cpu``: the numpy ops (the numerical reference), ``linear``'s choice of product, and
  ``forward_pass`` (BLAS threads around the skinny kernel);
- ``quant``: the quantized weight format (tiles of 16 rows, blocks of 32);
- ``qgemm``: integer products of quantized weights; ``skinny_gemm``: the float32 product of 1-8 rows;
- ``attention``: the attention kernel over the KV cache's key tiles and the K/V write;
- ``elementwise``: the compiled row-wise ops of a layer (RMSNorm, QK-norm, RoPE, SwiGLU and GeGLU,
  ``exp``);
- ``irgen``: LLVM IR building blocks of the hand-written kernels;
- ``cpu_features``: the host's instruction sets, read once;
- ``lock``: the lock every call of a parallel kernel holds.
"""
