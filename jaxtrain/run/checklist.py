"""The seed's runtime checklist, added to each metrics record: device and host memory, the loader's own rate and its
headroom over training, the data wait split into the host batch and the host-to-device transfer, a save's
blocking time as a share of the interval since the previous one; with optim.offload=host the host link's bytes and
time per step; with several processes each one's own time per step and the stragglers among them."""

from __future__ import annotations

import collections
import math
import os
import resource
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

RHO_WARN = 1.2  # loader rate / training rate under this: the loader is (nearly) the bottleneck
WINDOW = 20  # records over which the loader's and the training's rates are compared
MIN_RECORDS = 5  # no warning before: the first steps' start-up says little about the steady state
WARN_GAP_S = 300.0  # a low headroom (a straggler) is said when it starts, and again at most this often
STRAGGLER = 1.2  # a process whose own time per step is over this times the processes' median
STRAGGLER_FLOOR = 0.05  # ... by more than this share of the step: milliseconds of noise flag nobody
PROBE_BYTES = 256 << 20  # the host link's rate is measured on a copy of this size (or the master's, if smaller)
GATHER_EVERY = 10  # records between the processes' exchanges of their own times (each over these records)


def host_rss() -> tuple[int | None, int | None]:
  """(resident bytes now, peak resident bytes) of this process; None where the OS does not say (non-Linux)."""
  try:
    with open("/proc/self/statm") as f:
      now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    now = None
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if sys.platform.startswith("linux") else None
  # the kernel's high-water mark is synced from per-thread counters lazily: it can trail the current RSS a little
  return now, max(peak, now) if peak is not None and now is not None else peak


def device_memory(devices) -> tuple[int | None, int | None]:
  """Max over this process's devices of (bytes in use, peak bytes in use), from the backend's allocator statistics;
  (None, None) where the backend keeps none (the CPU backend: its arrays are host memory, in the host RSS)."""
  stats = [s for s in (d.memory_stats() for d in devices) if s and "bytes_in_use" in s]
  if not stats:
    return None, None
  return (max(s["bytes_in_use"] for s in stats),
          max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats))


def link_rate(device, nbytes: int) -> tuple[float, float]:
  """(host-to-device, device-to-host) bytes per second of `device`'s host link: one array of `nbytes` (at most
  PROBE_BYTES) copied from its host memory to the device and back, the best of 3. Once, at start-up: inside the
  step the copies overlap the update's math and cannot be timed apart from it."""
  n = max(min(nbytes, PROBE_BYTES) // 4, 1)
  here = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
  host = jax.device_put(np.zeros(n, np.float32), here.with_memory_kind("pinned_host"))
  up = down = float("inf")
  for _ in range(3):
    t0 = time.perf_counter()
    dev = jax.block_until_ready(jax.device_put(host, here))
    t1 = time.perf_counter()
    jax.block_until_ready(jax.device_put(dev, host.sharding))
    up, down = min(up, t1 - t0), min(down, time.perf_counter() - t1)
  return 4 * n / max(up, 1e-9), 4 * n / max(down, 1e-9)


class Stragglers:
  """Each process's own time per step (the step's interval less the time it waited for its devices, which includes
  waiting for the others in the step's collectives: what is left is its host's work, the batch above all), the
  mean over GATHER_EVERY records, exchanged among the processes then; a process over STRAGGLER times their median
  is flagged. Every process takes part in the exchange (a collective); process 0 says it."""

  def __init__(self):
    self.own, self.steps, self.waited = [], [], 0.0
    self.flagged, self.warned_at = (), None

  def wait(self, seconds: float) -> None:
    self.waited += seconds

  def fields(self, step: int, step_time: float) -> dict:
    self.own.append(step_time - self.waited)
    self.steps.append(step_time)
    self.waited = 0.0
    if len(self.own) < GATHER_EVERY:
      return {}
    mine = np.array([np.mean(self.own), np.mean(self.steps)])
    self.own, self.steps = [], []
    own_P, step_P = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2).T
    median = float(np.median(own_P))
    bar = max(STRAGGLER * median, median + STRAGGLER_FLOOR * float(np.median(step_P)))
    flagged = tuple(int(i) for i in np.flatnonzero(own_P > bar))
    self._warn(step, flagged, own_P, median)
    return {"process_own_s": [float(v) for v in own_P], "stragglers": list(flagged),
            "straggler_ratio": float(own_P.max() / max(median, 1e-9))}

  def _warn(self, step: int, flagged: tuple, own_P, median: float) -> None:
    now = time.monotonic()
    new = flagged and flagged != self.flagged and (self.warned_at is None or now - self.warned_at >= WARN_GAP_S)
    self.flagged = flagged
    if not new or jax.process_index() != 0:
      return
    self.warned_at = now
    who = ", ".join(f"process {i} {own_P[i] * 1e3:,.0f} ms" for i in flagged)
    print(f"jaxtrain: warning: straggler at step {step}: {who} of its own work per step (the processes' median "
          f"{median * 1e3:,.0f} ms, over the last {GATHER_EVERY} steps); the others wait for it in each step",
          file=sys.stderr, flush=True)


class Checklist:
  """One per run: the loop calls next_batch() for each batch, saved() after each save, fields() for each record."""

  def __init__(self, devices, batches, blocks: int, layout=None):
    self.devices, self.blocks = list(devices), blocks  # blocks: row blocks of a global batch (this process has one)
    self.link = None  # offload: ((h2d, d2h) bytes per step, their seconds at the link's measured rate)
    if layout is not None and layout.link is not None:
      rate = link_rate(self.devices[0], layout.link[0])
      self.link = layout.link, layout.link[0] / rate[0] + layout.link[1] / rate[1]
    self.clock = getattr(batches, "busy", None)  # the loader's BusyClock (jaxtrain.data.busy)
    self.window = collections.deque([(0, 0.0, 0, 0.0)], maxlen=WINDOW + 1)
    self.train_tokens, self.train_time, self.records = 0, 0.0, 0
    self.low, self.warned_at = False, None
    self.interval_start, self.save = time.perf_counter(), None
    self.multi = jax.process_count() > 1
    self.stragglers = Stragglers() if self.multi else None

  def waited(self, seconds: float) -> None:
    """Time the loop spent waiting for its devices (a dispatch that blocked, fetching a step's metrics)."""
    if self.stragglers is not None:
      self.stragglers.wait(seconds)

  def note(self) -> str:
    """Said once, with the start-up's last line, where device memory cannot be reported ('' elsewhere)."""
    if device_memory(self.devices) == (None, None):
      return (f" ({self.devices[0].platform} devices keep no memory statistics: device_mem_* are null in the "
              "metrics; host_rss_bytes counts their arrays)")
    return ""

  def next_batch(self, batches, put):
    """(device batch, (host wait, host-to-device seconds)). The transfer is waited for here: device_put returns
    before the copy is done, so the time to the call's return would not be the transfer. The next step needs the
    batch anyway and the step before it is already queued, so the device keeps working while the host waits."""
    t0 = time.perf_counter()
    host = next(batches)
    t1 = time.perf_counter()
    batch = jax.block_until_ready(put(host))
    return batch, (t1 - t0, time.perf_counter() - t1)

  def saved(self, start: float, end: float) -> float:
    """A save blocked from `start` to `end`: its share of the interval since the previous save's end (or since the
    steps began), given with the next record."""
    frac = (end - start) / max(end - self.interval_start, 1e-9)
    self.interval_start, self.save = end, (end - start, frac)
    return frac

  def fields(self, step: int, rec: dict, wait: tuple[float, float]) -> dict:
    mem, peak = device_memory(self.devices)
    rss, rss_peak = host_rss()
    out = {"data_host_s": wait[0], "data_h2d_s": wait[1], **self._headroom(step, rec),
           "device_mem_bytes": mem, "device_mem_peak_bytes": peak,
           "host_rss_bytes": rss, "host_rss_peak_bytes": rss_peak}
    if self.save is not None:
      out["ckpt_block_s"], out["ckpt_block_frac"] = self.save
      self.save = None
    if self.link is not None:
      (out["offload_h2d_bytes"], out["offload_d2h_bytes"]), out["offload_link_s"] = self.link
    if self.stragglers is not None:
      out.update(self.stragglers.fields(step, rec["step_time_s"]))
    return out

  def _headroom(self, step: int, rec: dict) -> dict:
    """data_tokens_per_sec (this process's loader, scaled to the global batch) and rho over the last WINDOW records."""
    if self.clock is None:
      return {"data_tokens_per_sec": None, "data_rho": None}
    self.train_tokens += rec["tokens"]
    self.train_time += rec["step_time_s"]
    self.records += 1
    self.window.append((*self.clock.read(), self.train_tokens, self.train_time))
    (t0, b0, tt0, tm0), (t1, b1, tt1, tm1) = self.window[0], self.window[-1]
    rate = (t1 - t0) * self.blocks / (b1 - b0) if b1 > b0 else None
    rho = rate / ((tt1 - tt0) / (tm1 - tm0)) if rate is not None and tt1 > tt0 and tm1 > tm0 else None
    self._warn(step, rho, rate, (tt1 - tt0) / (tm1 - tm0) if tm1 > tm0 else 0.0)
    return {"data_tokens_per_sec": rate, "data_rho": rho}

  def _warn(self, step: int, rho: float | None, rate: float | None, train_rate: float) -> None:
    """One line when the headroom falls under RHO_WARN (again only after it recovered, at most every WARN_GAP_S)."""
    if rho is None or self.records < MIN_RECORDS:
      return
    if rho >= RHO_WARN:
      self.low = False
      return
    now = time.monotonic()
    if not self.low and (self.warned_at is None or now - self.warned_at >= WARN_GAP_S):
      who = f"process {jax.process_index()}: " if self.multi else ""
      print(f"jaxtrain: warning: {who}data loader headroom rho {rho:.2f} < {RHO_WARN} at step {step}: it builds "
            f"{rate:,.0f} tok/s, training takes {train_rate:,.0f} tok/s; raise data.workers",
            file=sys.stderr, flush=True)
      self.warned_at = now
    self.low = True
