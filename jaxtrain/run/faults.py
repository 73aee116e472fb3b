"""Fault-injection hooks for the failure rehearsals (tests), off unless asked for.

JAXTRAIN_FAULTS="hold_manifest=STEP:SECONDS" makes the save of STEP wait SECONDS after
orbax's commit and before the manifest is written, so a test can kill the process
while that save is still in flight.
JAXTRAIN_FAULTS="enospc_at=STEP" makes the save of STEP fail as a full disk would (for
machines where a test cannot mount a small tmpfs).
JAXTRAIN_FAULTS="metrics_enospc_at=STEP" makes the metrics.jsonl write of STEP (and every
later one) fail as a full disk would.
`hold_manifest=STEP:PATH` (a path instead of seconds) holds until PATH exists (at most 10 min).
"""

import errno
import os
import time


def _spec(name: str) -> str | None:
  for item in os.environ.get("JAXTRAIN_FAULTS", "").split(","):
    key, _, value = item.partition("=")
    if key.strip() == name:
      return value
  return None


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
