"""Fit before allocate: the memory bill against the device's memory, before any array exists.

The trainer (and bench) build the step's set-up abstractly, then call `check`: when the
bill (jaxtrain.analysis.memory, without its safety margin, for the plan that will run) exceeds the
memory of one device, the run stops with one line naming what it needs, what is
available and the largest items, instead of an XLA RESOURCE_EXHAUSTED traceback after
the allocation. What counts as "known" memory:
  GPU/TPU  the runtime's own limit (`memory_stats()["bytes_limit"]`), else the device
           table's figure for the device kind;
  CPU      the host's physical memory divided by the local devices (simulated CPU devices
           share it).
`run.fit_check = false` skips the check (e.g. when the bill is known to overestimate).
"""

from __future__ import annotations

import os

from jaxtrain.parallel import devices
from jaxtrain.analysis import memory
from jaxtrain.core.errors import UserError


def host_memory() -> int | None:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def capacity(mesh) -> tuple[int | None, str]:
  """(bytes per device, where the figure comes from) for the mesh's local devices."""
  import jax
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()] or list(mesh.devices.flat)
  dev = local[0]
  if dev.platform == "cpu":
    host = host_memory()
    n = len(jax.local_devices(backend="cpu"))
    return (None, "unknown") if host is None else (host // n, f"host memory / {n} CPU device(s)")
  try:
    limit = (dev.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 - some backends do not implement memory_stats
    limit = None
  if limit:
    return int(limit), f"{dev.device_kind} runtime limit"
  entry = devices.lookup(dev.device_kind)
  if entry and entry.memory_bytes:
    return entry.memory_bytes, f"{dev.device_kind} (device table)"
  return None, "unknown"


def check(setup, enabled: bool = True) -> None:
  """A UserError (one line) when the step cannot fit one device; nothing when it can or
  when the device's memory is not known."""
  if not enabled:
    return
  have, source = capacity(setup.mesh)
  if have is None:
    return
  b = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.0)
  if b.total <= have:
    return
  big = sorted(((v, k) for k, v in b.items.items() if v), reverse=True)[:3]
  largest = ", ".join(f"{k} {memory.human(v)}" for v, k in big)
  raise UserError(f"does not fit: needs {memory.human(b.total)} per device, {memory.human(have)} available "
                  f"({source}); largest items {largest}; see python -m jaxtrain.inspect, or set run.fit_check=false "
                  "to try anyway")
