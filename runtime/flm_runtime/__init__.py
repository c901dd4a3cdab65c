"""flm_runtime: a local LLM runtime (numpy cpu backend, pyxrt npu backend) with DFlash speculative
decoding. Usable without LiteLLM; ``litellm_flm`` is a thin layer on top."""
