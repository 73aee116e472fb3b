"""The loader's own clock: tokens built and the wall time during which at least one worker was building.

The time spent inside next(batches) is the training loop's wait, not the loader's work: with prefetch it is near
zero while the workers are busy. Counting the wall time with any worker busy (the union of the workers' intervals,
not their sum) gives the rate the loader sustains when it never waits for a free prefetch slot, with its workers'
parallelism included."""

from __future__ import annotations

import threading
import time

import numpy as np


class BusyClock:
  def __init__(self):
    self._lock, self._active, self._since = threading.Lock(), 0, 0.0
    self._tokens, self._busy = 0, 0.0

  def timed(self, build, *args) -> dict[str, np.ndarray]:
    """build(*args), a batch dict, with its valid tokens and busy time counted."""
    with self._lock:
      if not self._active:
        self._since = time.perf_counter()
      self._active += 1
    try:
      batch = build(*args)
    finally:
      with self._lock:
        self._active -= 1
        if not self._active:
          self._busy += time.perf_counter() - self._since
    with self._lock:
      self._tokens += int(np.count_nonzero(batch["loss_mask"]))
    return batch

  def read(self) -> tuple[int, float]:
    """(valid tokens built, busy seconds) so far; a build in progress counts up to now."""
    with self._lock:
      busy = self._busy + (time.perf_counter() - self._since if self._active else 0.0)
      return self._tokens, busy
