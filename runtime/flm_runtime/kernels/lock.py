"""The lock every call of a parallel kernel holds.

numba's "workqueue" threading layer aborts the process when two threads enter a parallel kernel
at once, and two engines (two loaded models) run in two threads; a step of the kernel team
(``kernels.team``) spins its threads at barriers, and beside another parallel kernel they would
fight for the same CPUs. Every call of a parallel kernel (``skinny_gemm``, ``attention.attend``)
and every team step (a model's step, a ``qgemm.qlinear`` product) therefore holds this one
process-wide lock; on 2 cores the calls would only contend anyway.
"""

from __future__ import annotations

import threading

KERNEL_LOCK = threading.Lock()
