"""Step timing shared by `bench` and `bench --compare`: the pipelined step timer, its
statistics, and the first batches of jaxtrain's data path."""

from __future__ import annotations

import time


def stats(xs) -> dict:
  import numpy as np
  a = np.asarray(xs, float)
  return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
          "p25": float(np.percentile(a, 25)), "p75": float(np.percentile(a, 75)), "n": int(a.size)}


def time_steps(run, sync, n: int, pipelined: bool = True) -> list[float]:
  """Per-step seconds of n steps: `run()` dispatches one step and returns a handle,
  `sync(handle)` waits for it. Pipelined (asynchronous dispatch): step s's end is awaited
  while s+1 is already queued. Otherwise (`run` returns when the step is done, e.g.
  torch on CPU) each step is timed alone."""
  if not pipelined:
    times = []
    for _ in range(n):
      t = time.perf_counter()
      sync(run())
      times.append(time.perf_counter() - t)
    return times
  times, pending, last = [], None, time.perf_counter()
  for _ in range(n):
    handle = run()
    if pending is not None:
      sync(pending)
      now = time.perf_counter()
      times.append(now - last)
      last = now
    pending = handle
  sync(pending)
  times.append(time.perf_counter() - last)
  return times


def unpack(batch: dict) -> dict:
  """The same tokens with each row one document: one segment, positions 0..L-1."""
  import numpy as np
  B, L = batch["inputs"].shape
  return {**batch, "segment_ids": np.ones((B, L), np.int32),
          "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()}


def first_batches(cfg, setup, n: int, unpacked: bool) -> list[dict]:
  """The first n numpy batches of this process from jaxtrain's data path."""
  from jaxtrain import data
  it = data.batches(cfg, *setup.placement.rows())
  try:
    out = [next(it) for _ in range(n)]
  finally:
    it.close()
  return [unpack(b) for b in out] if unpacked else out
