"""The decoder layers: what a checkpoint turns on in them (``spec``), their numpy reference
(``decoder``) and a quantized model's layers as one compiled step on the kernel team (``stack``).
The kernels they run are ``flm_runtime.kernels``."""
