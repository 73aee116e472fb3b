"""Pipeline schedules as static tables (pure Python): chunk c of the p*v lives on device c % p as local chunk
c // p; a simulator places each device's ops at the first tick their inputs have arrived."""

from __future__ import annotations

import dataclasses
import functools

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs")
F, B = 1, 2  # op kinds


@dataclasses.dataclass(frozen=True)
class Op:
  kind: int  # F or B
  mb: int  # microbatch
  chunk: int  # local chunk index j on its device (global chunk j*p + device)


def _fwd_order(p: int, v: int, k: int) -> tuple[int, int]:
  """(microbatch, local chunk) of a device's k-th forward, microbatches in groups of p through chunk 0, 1, ..."""
  group, within = divmod(k, p * v)
  return group * p + within % p, within // p


def device_order(name: str, p: int, m: int, v: int, s: int) -> list[Op]:
  """The ops of device `s`: all forwards then all backwards, or (1f1b, interleaved) warm-up then alternating."""
  if name in ("gpipe", "looped-bfs"):
    fwd = [Op(F, i, j) for j in range(v) for i in range(m)]
    return fwd + [Op(B, i, j) for j in reversed(range(v)) for i in range(m)]
  if name == "1f1b":
    fwd = [Op(F, i, 0) for i in range(m)]
    bwd = [Op(B, i, 0) for i in range(m)]
    warm = min(p - 1 - s, m)
  else:  # interleaved (`check` admits no other name)
    fwd = [Op(F, *_fwd_order(p, v, k)) for k in range(m * v)]
    bwd = [Op(B, mb, v - 1 - j) for mb, j in (_fwd_order(p, v, k) for k in range(m * v))]
    warm = min(2 * (p - 1 - s) + (v - 1) * p, m * v)
  out = fwd[:warm]
  for k in range(len(fwd) - warm):
    out += [fwd[warm + k], bwd[k]]
  return out + bwd[len(fwd) - warm:]


@dataclasses.dataclass(frozen=True)
class Table:
  """A placed schedule. grid[t][s] is the Op of device s at tick t, or None (idle)."""
  name: str
  p: int
  m: int
  v: int
  grid: tuple[tuple[Op | None, ...], ...]

  @property
  def ticks(self) -> int:
    return len(self.grid)

  @property
  def chunks(self) -> int:
    return self.p * self.v

  def bubble(self) -> float:
    """Fraction of device-ticks spent idle, from the table."""
    idle = sum(op is None for row in self.grid for op in row)
    return idle / (self.ticks * self.p)

  def bubble_formula(self) -> float:
    return (self.p - 1) / (self.v * self.m + self.p - 1)

  def done(self) -> dict[tuple[int, int, int], int]:
    """{(kind, microbatch, global chunk): tick}."""
    return {(op.kind, op.mb, op.chunk * self.p + s): t
            for t, row in enumerate(self.grid) for s, op in enumerate(row) if op is not None}

  def stash_intervals(self) -> list[list[tuple[int, int, int, int]]]:
    """Per device: (arrival, last use, microbatch, global chunk) of each stashed chunk input (none for chunk 0)."""
    done, out = self.done(), [[] for _ in range(self.p)]
    for (kind, mb, c), t in done.items():
      if kind == F and c > 0:
        out[c % self.p].append((done[(F, mb, c - 1)] + 1, done[(B, mb, c)], mb, c))
    return out

  def grad_intervals(self) -> list[list[tuple[int, int, int, int]]]:
    """Per device: the output gradients waiting for their chunk's backward."""
    done, out, last = self.done(), [[] for _ in range(self.p)], self.chunks - 1
    for (kind, mb, c), t in done.items():
      if kind == B and c < last:
        out[c % self.p].append((done[(B, mb, c + 1)] + 1, t, mb, c))
    return out

  def in_flight(self) -> list[int]:
    """Per device: the most chunk inputs stashed at one time."""
    return [_max_overlap(iv) for iv in self.stash_intervals()]

  def timeline(self) -> str:
    """One row per device, one cell per tick: F3 / B3 (microbatch 3), a/b/.. = local chunk, '.' idle."""
    def cell(op):
      return "." if op is None else (("F" if op.kind == F else "B") + str(op.mb)
                                     + (chr(ord("a") + op.chunk) if self.v > 1 else ""))
    cells = [[cell(self.grid[t][s]) for t in range(self.ticks)] for s in range(self.p)]
    w = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(w) for c in row) for s, row in enumerate(cells))


def _max_overlap(intervals) -> int:
  """The most intervals [a, b] in use at one tick (the peak is at some interval's start)."""
  return max((sum(a <= t <= b for a, b, _, _ in intervals) for t, _, _, _ in intervals), default=0)


def assign_slots(intervals) -> tuple[dict[tuple[int, int], int], int]:
  """({(mb, chunk): slot}, slot count): overlapping intervals never share a slot (lowest free first)."""
  slot_of, busy_until = {}, []  # busy_until[k]: last tick slot k is in use
  for a, b, mb, c in sorted(intervals):
    k = next((k for k, until in enumerate(busy_until) if until < a), len(busy_until))
    busy_until[k:k + 1] = [b]  # takes a free slot, or appends one
    slot_of[(mb, c)] = k
  return slot_of, len(busy_until)


def check(name: str, p: int, m: int, v: int) -> str | None:
  """Why (name, p, m, v) is not a valid schedule, or None."""
  if name not in SCHEDULES:
    return f"pipeline.schedule={name!r} is not one of {', '.join(SCHEDULES)}"
  if name in ("gpipe", "1f1b") and v != 1:
    return f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved or looped-bfs ({name} runs 1 chunk per device)"
  if name in ("interleaved", "looped-bfs") and v < 2:
    return f"pipeline.schedule={name} needs pipeline.virtual_stages >= 2 (got {v}); use 1f1b or gpipe for 1"
  if m < p:
    return f"train.microbatches={m} must be >= the pipeline stages ({p}) so that every stage gets work"
  if name == "interleaved" and m % p:
    return f"pipeline.schedule=interleaved runs microbatches in groups of pipeline={p}: train.microbatches={m} must be a multiple of {p}"
  return None


@functools.lru_cache(maxsize=64)
def build(name: str, p: int, m: int, v: int = 1) -> Table:
  """Places every device's ops at the earliest tick their inputs are there."""
  if why := check(name, p, m, v):
    raise ValueError(why)
  orders = [device_order(name, p, m, v, s) for s in range(p)]
  nxt, done, last, grid = [0] * p, {}, p * v - 1, []
  while any(n < len(o) for n, o in zip(nxt, orders)):
    t, row = len(grid), []
    for s in range(p):
      op = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
      if op is not None:
        c = op.chunk * p + s
        if op.kind == F:
          ready = c == 0 or done.get((F, op.mb, c - 1), t) < t
        else:
          ready = done.get((F, op.mb, c), t) < t and (c == last or done.get((B, op.mb, c + 1), t) < t)
        if not ready:
          op = None
      row.append(op)
    if all(op is None for op in row):
      raise RuntimeError(f"schedule {name} p={p} m={m} v={v} deadlocks at tick {t}")
    for s, op in enumerate(row):
      if op is not None:
        done[(op.kind, op.mb, op.chunk * p + s)] = t
        nxt[s] += 1
    grid.append(tuple(row))
  return Table(name, p, m, v, tuple(grid))
