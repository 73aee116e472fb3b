"""Fault injection for the failure rehearsals (tests), off unless JAXTRAIN_FAULTS names one:
hold_manifest=STEP:SECONDS|PATH, enospc_at=STEP, metrics_enospc_at=STEP, loader_fail_at=STEP (reading a row of
the batch of training step STEP fails with EIO, in the loader's worker thread, as a broken disk would),
kill=WHERE:STEP:PROCESS:MARKER (SIGKILL of that process at `step` (a step dispatched, not finished), `save`
(an async save in flight, before its manifest) or `restore` (restoring that step); once: MARKER is created
first, so the restarted trainer runs on), slow=PROCESS:SECONDS:FROM (that process's host works SECONDS more for
each step from step FROM on: a straggler)."""

import errno
import os
import signal
import time


def _spec(name: str) -> str | None:
  return next((v for k, _, v in (i.partition("=") for i in os.environ.get("JAXTRAIN_FAULTS", "").split(","))
               if k.strip() == name), None)


def before_manifest(step: int) -> None:
  spec = _spec("hold_manifest")
  if spec:
    at, _, seconds = spec.partition(":")
    if int(at) == step:
      print(f"fault: holding the manifest of step {step} for {seconds}s", flush=True)
      if seconds.replace(".", "", 1).isdigit():
        time.sleep(float(seconds))
        return
      deadline = time.time() + 600
      while not os.path.exists(seconds) and time.time() < deadline:
        time.sleep(0.05)


def before_save(step: int) -> None:
  at = _spec("enospc_at")
  if at and int(at) == step:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(injected fault)")


def metrics_write(step: int) -> None:
  at = _spec("metrics_enospc_at")
  if at and step >= int(at):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(injected fault)")


def kill_point(where: str, step: int) -> None:
  spec = _spec("kill")
  if not spec:
    return
  at_where, at_step, process, marker = spec.split(":", 3)
  import jax
  if (at_where, int(at_step), int(process)) != (where, step, jax.process_index()) or os.path.exists(marker):
    return
  open(marker, "w").close()
  print(f"fault: killing process {process} at {where} {step}", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def loader_read(step: int) -> None:
  at = _spec("loader_fail_at")
  if at and int(at) == step:
    raise OSError(errno.EIO, os.strerror(errno.EIO), "(injected fault)")


def slow_point(step: int) -> None:
  spec = _spec("slow")
  if not spec:
    return
  process, seconds, start = spec.split(":")
  import jax
  if int(process) == jax.process_index() and step >= int(start):
    time.sleep(float(seconds))
