"""Pipeline schedules as static tables: which device runs what at every tick.

Pure Python (no JAX). A model of `p * v` chunks runs on `p` pipeline devices; chunk c
(layers [c*n/(p*v), (c+1)*n/(p*v))) lives on device c % p as its local chunk c // p, so
activations flow device s -> s+1 and, with v > 1, wrap from the last device to the first.
A tick is one unit of work on every device: a forward (F) or a backward (B, which
recomputes the chunk's forward from its stashed input) of one microbatch on one chunk,
or idle. Each device runs its ops in a fixed order (the schedule); a simulator places
every op at the first tick its inputs have arrived (sent at the end of an earlier tick).

  gpipe        all forwards, then all backwards (every microbatch's input stashed at once)
  1f1b         p-1-s warm-up forwards on device s, then one forward / one backward
               alternately, then the remaining backwards: at most p-s inputs stashed
  interleaved  1f1b over v chunks per device, microbatches in groups of p (Megatron's
               looped depth-first order): the bubble shrinks by v, traffic grows by v
  looped-bfs   breadth-first looped: every microbatch through chunk 0, then chunk 1, ...
               (GPipe over v chunks: small bubble, GPipe's memory)

Bubble: idle ticks / all ticks. With every op one tick, GPipe and 1F1B take
2(m+p-1) ticks for 2m ops per device: (p-1)/(m+p-1); interleaved takes 2(vm+p-1) ticks
for 2vm: (p-1)/(vm+p-1), i.e. idle/busy = (p-1)/(vm), 1/v of GPipe's (p-1)/m.
"""

from __future__ import annotations

import dataclasses
import functools

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs")
IDLE, F, B = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Op:
  kind: int  # F or B
  mb: int  # microbatch
  chunk: int  # local chunk index j on its device (global chunk j*p + device)


def _fwd_order(p: int, m: int, v: int, k: int) -> tuple[int, int]:
  """(microbatch, local chunk) of a device's k-th forward in depth-first looped order:
  microbatches in groups of p, each group through chunk 0, then chunk 1, ..."""
  group, within = divmod(k, p * v)
  return group * p + within % p, within // p


def device_order(name: str, p: int, m: int, v: int, s: int) -> list[Op]:
  """The ops of device `s`, in the order it runs them."""
  if name in ("gpipe", "looped-bfs"):
    fwd = [Op(F, i, j) for j in range(v) for i in range(m)]
    return fwd + [Op(B, i, j) for j in reversed(range(v)) for i in range(m)]
  if name == "1f1b":
    fwd = [Op(F, i, 0) for i in range(m)]
    bwd = [Op(B, i, 0) for i in range(m)]
    warm = min(p - 1 - s, m)
  elif name == "interleaved":
    fwd = [Op(F, *_fwd_order(p, m, v, k)) for k in range(m * v)]
    bwd = [Op(B, mb, v - 1 - j) for mb, j in (_fwd_order(p, m, v, k) for k in range(m * v))]
    warm = min(2 * (p - 1 - s) + (v - 1) * p, m * v)
  else:
    raise ValueError(name)
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
    p, m, v = self.p, self.m, self.v
    return (p - 1) / (v * m + p - 1)

  def done(self) -> dict[tuple[int, int, int], int]:
    """{(kind, microbatch, global chunk): tick}."""
    return {(op.kind, op.mb, op.chunk * self.p + s): t
            for t, row in enumerate(self.grid) for s, op in enumerate(row) if op is not None}

  def stash_intervals(self) -> list[list[tuple[int, int, int, int]]]:
    """Per device: (arrival tick, last tick used, microbatch, global chunk) of every
    stashed chunk input. The input of chunk c > 0 arrives at the end of the tick its
    forward ran upstream and is kept until its backward (which recomputes from it)
    has run. Chunk 0 stashes nothing: its input is re-embedded from the tokens."""
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
    """One row per device, one cell per tick: F3 / B3 (microbatch 3), a/b/.. = local chunk
    when v > 1, '.' idle."""
    def cell(op):
      if op is None:
        return "."
      return ("F" if op.kind == F else "B") + str(op.mb) + (chr(ord("a") + op.chunk) if self.v > 1 else "")
    cells = [[cell(self.grid[t][s]) for t in range(self.ticks)] for s in range(self.p)]
    w = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(w) for c in row) for s, row in enumerate(cells))


def _max_overlap(intervals) -> int:
  events = sorted([(a, 1) for a, _, _, _ in intervals] + [(b + 1, -1) for _, b, _, _ in intervals],
                  key=lambda e: (e[0], e[1]))
  best = cur = 0
  for _, d in events:
    cur += d
    best = max(best, cur)
  return best


def assign_slots(intervals) -> tuple[dict[tuple[int, int], int], int]:
  """Buffer slot of each (microbatch, chunk) so that no two overlapping intervals share
  one (lowest free slot first); returns ({(mb, chunk): slot}, number of slots)."""
  slot_of, busy_until = {}, []  # busy_until[k]: last tick slot k is in use
  for a, b, mb, c in sorted(intervals):
    free = [k for k, until in enumerate(busy_until) if until < a]
    k = free[0] if free else len(busy_until)
    if k == len(busy_until):
      busy_until.append(b)
    busy_until[k] = b
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
  why = check(name, p, m, v)
  if why:
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
