"""Fit: the one verdict of bytes needed against a device's memory, and the trainer's check
before any array exists (a one-line error instead of RESOURCE_EXHAUSTED after allocating).
"""

from __future__ import annotations

import os

from jaxtrain.analysis import memory
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import devices

NO_MEMORY = "no device memory known: give --device-memory (e.g. 80GiB or H100) for a verdict"


def largest(items: dict[str, int], n: int = 3) -> str:
  return ", ".join(f"{k} {memory.human(v)}" for v, k in sorted(((v, k) for k, v in items.items() if v),
                                                                reverse=True)[:n])


def verdict(need: int, have: int | None, items: dict[str, int] | None = None,
            compiler: str | None = None) -> tuple[bool | None, str]:
  """(fits, one line): None when `have` is unknown. With `compiler`, the line is about that
  compiler's total; else the headroom, or the shortfall and the `items` largest."""
  if have is None:
    return None, NO_MEMORY
  fits, h = need <= have, memory.human
  if compiler:
    return fits, f"{'fits' if fits else 'does not fit'}: compiled total {h(need)} of {h(have)} ({compiler})"
  if fits:
    return True, f"fits: {h(need)} of {h(have)} ({h(have - need)} free)"
  return False, f"does not fit: misses by {h(need - have)} ({h(need)} of {h(have)}); largest: {largest(items or {})}"


def capacity(mesh) -> tuple[int | None, str]:
  """(bytes per device, where the figure comes from) for the mesh's local devices."""
  import jax
  dev = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), mesh.devices.flat[0])
  if dev.platform == "cpu":
    try:
      host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None, "unknown"
    n = len(jax.local_devices(backend="cpu"))
    return host // n, f"host memory / {n} CPU device(s)"
  try:
    limit = (dev.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 - some backends do not implement memory_stats
    limit = None
  if limit:
    return int(limit), f"{dev.device_kind} runtime limit"
  entry = devices.of(dev).entry
  if entry and entry.memory_bytes:
    return entry.memory_bytes, f"{dev.device_kind} (device table)"
  return None, "unknown"


def check(setup, enabled: bool = True) -> None:
  """A UserError (one line) when the bill (no margin, the plan that runs) cannot fit one
  device; nothing when it can or when the device's memory is not known."""
  have, source = capacity(setup.mesh) if enabled else (None, "")
  if have is None:
    return
  b = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.0)
  if verdict(b.total, have)[0] is False:
    raise UserError(f"does not fit: needs {memory.human(b.total)} per device, {memory.human(have)} available "
                    f"({source}); largest items {largest(b.items)}; see python -m jaxtrain.inspect, or set "
                    "run.fit_check=false to try anyway")
