"""Speculation: DFlash speculative steps (``speculative.py``), the speculation policy and prompt
lookup; ``flm_runtime.api`` hands the engine of a DFlash tag a ``SpeculativeDecoder``."""
