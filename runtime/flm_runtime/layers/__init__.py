"""Layer composition: one decoder layer (``decoder``) over an ops table (``ops``) for the features
a checkpoint turns on (``spec``). The kernels it composes are ``flm_runtime.kernels``."""
