"""XLA:CPU's step temporaries stay in the heap (jaxtrain.core.cpu_heap): after the train step's setup on CPU
devices, a block larger than glibc's mmap ceiling (32 MiB) is served from the heap and, freed, comes back
to the next allocation as it was, not as freshly mapped zero pages (what glibc does by default)."""

import ctypes

import pytest

from jaxtrain.core import config
from jaxtrain.run import step
from tests.helpers import mesh_of


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                             "fsmblks", "uordblks", "fordblks", "keepcost")]


def test_a_large_block_is_reused_from_the_heap_after_the_step_setup():
  libc = ctypes.CDLL(None)
  if not hasattr(libc, "mallinfo2"):
    pytest.skip("not glibc >= 2.33")
  libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
  libc.free.argtypes, libc.mallinfo2.restype = [ctypes.c_void_p], _Mallinfo2
  step.Setup(config.load("tiny"), mesh_of("dp=1"))
  size, at = 48 << 20, 40 << 20  # the marker far from the chunk header glibc writes into a freed block
  mapped = libc.mallinfo2().hblkhd
  block = libc.malloc(size)
  assert libc.mallinfo2().hblkhd == mapped  # not a mapping of its own
  ctypes.memset(block + at, 0x5A, 64)
  libc.free(block)
  again = libc.malloc(size)
  try:
    assert ctypes.string_at(again + at, 64) == b"\x5a" * 64  # the same memory, not new zero-filled pages
  finally:
    libc.free(again)
