"""The loader's busy clock: the wall time with any worker building (the union of the workers' intervals, not their
sum), against the test's own clock."""

import threading
import time

import numpy as np
import pytest

from jaxtrain.data import busy


def _build(seconds: float, valid: int):
  def build():
    time.sleep(seconds)
    return {"loss_mask": np.array([1] * valid + [0] * 3)}
  return build


def test_overlapping_builds_count_once_and_idle_time_not_at_all():
  clock = busy.BusyClock()
  clock.timed(_build(0.1, 5))
  time.sleep(0.2)  # idle: a full prefetch buffer
  t = time.perf_counter()
  workers = [threading.Thread(target=clock.timed, args=(_build(0.2, 7),)) for _ in range(2)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  both = time.perf_counter() - t
  tokens, seconds = clock.read()
  assert tokens == 5 + 2 * 7
  assert 0.1 + 0.2 <= seconds <= 0.1 + both + 0.02  # two 0.2 s builds side by side: about 0.2 s, not 0.4


def test_a_build_in_progress_counts_up_to_now():
  clock = busy.BusyClock()
  worker = threading.Thread(target=clock.timed, args=(_build(0.3, 1),))
  worker.start()
  time.sleep(0.15)
  assert clock.read()[1] == pytest.approx(0.15, abs=0.1)
  worker.join()
  assert clock.read()[0] == 1
