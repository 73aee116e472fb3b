"""XLA:CPU's per-step temporaries kept in the heap. The CPU runtime allocates a program's temporaries as one
block per device (tens of MiB for a train step) at every execution and frees it after. glibc serves a block
above its mmap ceiling (32 MiB) with a fresh mapping each time, so every step the kernel maps it, zero-fills
it page by page and unmaps it again: a third of the CPU time of a small tensor-parallel step without remat
(docs/performance.md). `keep()` has glibc serve every block from its heaps and keep freed memory for the next
step; the process then holds its peak memory instead of handing it back. Process-wide, glibc only. Not
reached: a block above 64 MiB that a thread's own arena cannot hold, which glibc still maps each time."""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)


@functools.cache
def keep() -> bool:
  """Once per process; False where the C library has no mallopt (not glibc: its allocator decides)."""
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  # no block from mmap, and a freed top of the heap is never trimmed (below 2 GiB free at the top)
  return bool(mallopt(M_MMAP_MAX, 0)) & bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
