"""The lock every call of a numba parallel kernel holds.

numba's default thread pool (its "workqueue" layer) aborts the process when two threads enter a
parallel kernel at once, and two engines (two loaded models) run in two threads. Every call of a
parallel kernel (``qgemm``, ``skinny_gemm``, ``attention``, a compiled decoder layer) therefore
holds this one process-wide lock; on 2 cores the calls would only contend anyway.
"""

from __future__ import annotations

import threading

KERNEL_LOCK = threading.Lock()
