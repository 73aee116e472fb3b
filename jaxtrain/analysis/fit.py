"""Fit: the one verdict of bytes needed against a device's memory, and the trainer's check
before any array exists (a one-line error instead of RESOURCE_EXHAUSTED after allocating).
"""

from __future__ import annotations

import os
import re

from jaxtrain.analysis import memory
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import devices

_OOM = re.compile(r"RESOURCE_EXHAUSTED|out of memory", re.IGNORECASE)
# what a command can change when its device runs out of memory (cli.main's prog -> advice)
_ADVICE = {
    "train": "lower train.batch_size (or raise train.microbatches), set model.remat=full, lower model.lora_rank "
             "where LoRA is on, or spread the state over more devices (--mesh fsdp=N); python -m jaxtrain.inspect "
             "shows the bill item by item",
    "generate": "generate fewer sequences at once (--prompts-file), fewer --max-new-tokens, or spread the model over "
                "more devices (--mesh fsdp=N)",
    "hf": "spread the model over more devices (--mesh fsdp=N)",
}
_billed: list = []  # the last fit check's setup: its bill is the figure an out-of-memory line gives

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
  _billed[:] = [setup]
  have, source = capacity(setup.mesh) if enabled else (None, "")
  if have is None:
    return
  b = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.0)
  if verdict(b.total, have)[0] is False:
    raise UserError(f"does not fit: needs {memory.human(b.total)} per device, {memory.human(have)} available "
                    f"({source}); largest items {largest(b.items)}; see python -m jaxtrain.inspect, or set "
                    "run.fit_check=false to try anyway")


def oom_line(err: BaseException) -> str | None:
  """The error's own first line when `err` is a device out-of-memory (XLA's RESOURCE_EXHAUSTED, raised as
  XlaRuntimeError or JaxRuntimeError; torch's OutOfMemoryError, the torch baseline's); None for any other error."""
  if not any(c.__name__ in ("XlaRuntimeError", "JaxRuntimeError", "OutOfMemoryError") for c in type(err).__mro__):
    return None
  if not _OOM.search(text := str(err)):
    return None
  return next((line.strip() for line in text.splitlines() if line.strip()), "")[:200]


def out_of_memory(err: BaseException, command: str) -> UserError | None:
  """A device out-of-memory at run time as one line: XLA's line, the memory bill's figure where the command billed a
  train step (train, bench: fit.check), and what `command` (cli.main's prog) can change; None for any other error.
  A user error (exit 2): the same command does not fit on a second try."""
  if (first := oom_line(err)) is None:
    return None
  kind = command.split("[")[0].split()[0].removeprefix("jaxtrain").lstrip(".") or "train"  # "jaxtrain.hf import"
  billed = ""
  if _billed and kind not in ("generate", "hf"):
    try:
      total = memory.bill(_billed[0], memory.grouped(memory.param_rows(_billed[0])), 0.0).total
      billed = f"; the memory bill counted {memory.human(total)} per device"
    except Exception:  # noqa: BLE001 - the figure helps; the line stands without it
      pass
  return UserError(f"device out of memory ({first}){billed}: {_ADVICE.get(kind, _ADVICE['train'])}")
