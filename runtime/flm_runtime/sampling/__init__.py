"""Sampling: from a position's logits to its token: the sampler (warp and draw), the logits
processors, the grammar masks and the request's ``Picker``."""
