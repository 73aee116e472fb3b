"""Pipeline schedules as static tables (pure Python): chunk c of the p*v lives on device c % p as local chunk
c // p (zbv: in a V, device d holds chunks d and 2p-1-d); a simulator places each device's ops at the first
tick their inputs have arrived. Zero-bubble schedules split the backward into B (the chunk input's gradient)
and W (the weights' gradient), W being free to fill the bubbles."""

from __future__ import annotations

import dataclasses
import functools

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv")
SPLIT = ("zb-h1", "zbv")  # backward as B then W; elsewhere B is the whole backward
F, B, W = 1, 2, 3  # op kinds


@dataclasses.dataclass(frozen=True)
class Op:
  kind: int  # F, B or W
  mb: int  # microbatch
  chunk: int  # local chunk index j on its device (global chunk: `Table.chunk_of`)


def _fwd_order(p: int, v: int, k: int) -> tuple[int, int]:
  """(microbatch, local chunk) of a device's k-th forward, microbatches in groups of p through chunk 0, 1, ..."""
  group, within = divmod(k, p * v)
  return group * p + within % p, within // p


def device_order(name: str, p: int, m: int, v: int, s: int) -> list[Op]:
  """The ops of device `s`: all forwards then all backwards, or (1f1b, interleaved) warm-up then alternating."""
  if name in ("gpipe", "looped-bfs"):
    fwd = [Op(F, i, j) for j in range(v) for i in range(m)]
    return fwd + [Op(B, i, j) for j in reversed(range(v)) for i in range(m)]
  if name == "zb-h1":  # 1F1B's F/B order; device s runs W of microbatch i after the B of i + s (the rest last)
    fb = device_order("1f1b", p, m, v, s)
    out, nb = [], 0
    for op in fb:
      out.append(op)
      nb += op.kind == B
      if op.kind == B and nb > s:
        out.append(Op(W, nb - 1 - s, 0))
    return out + [Op(W, i, 0) for i in range(max(m - s, 0), m)]
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


def chunk_of(name: str, p: int, s: int, j: int) -> int:
  """The global chunk of local chunk j on device s: looped (j*p + s), or zbv's V (s, then 2p-1-s)."""
  return (2 * p - 1 - s if j else s) if name == "zbv" else j * p + s


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

  @property
  def split(self) -> bool:
    return self.name in SPLIT

  def chunk_of(self, s: int, j: int) -> int:
    return chunk_of(self.name, self.p, s, j)

  def device_of(self, c: int) -> tuple[int, int]:
    """(device, local chunk) of global chunk c."""
    return next((s, j) for s in range(self.p) for j in range(self.v) if self.chunk_of(s, j) == c)

  def span(self, cost=None) -> float:
    """The step's length in lock-step ticks: each tick lasts as long as its slowest op (`cost`: {kind: seconds};
    default 1 each)."""
    cost = cost or {F: 1.0, B: 1.0, W: 1.0}
    return sum(max(cost[op.kind] for op in row if op is not None) for row in self.grid)

  def bubble(self, cost=None) -> float:
    """Fraction of device time spent idle in lock-step ticks (`span`)."""
    cost = cost or {F: 1.0, B: 1.0, W: 1.0}
    busy = sum(cost[op.kind] for row in self.grid for op in row if op is not None)
    return 1 - busy / (self.span(cost) * self.p)

  def bubble_formula(self) -> float:
    """Unit costs: (p-1) idle ticks per device over the v*m F and B (and W) ticks of one device."""
    return (self.p - 1) / ((3 if self.split else 1) * self.v * self.m + self.p - 1)

  def done(self) -> dict[tuple[int, int, int], int]:
    """{(kind, microbatch, global chunk): tick}."""
    return {(op.kind, op.mb, self.chunk_of(s, op.chunk)): t
            for t, row in enumerate(self.grid) for s, op in enumerate(row) if op is not None}

  def stash_intervals(self) -> list[list[tuple[int, int, int, int]]]:
    """Per device: (arrival, last use, microbatch, global chunk) of each stashed chunk input (none for chunk 0);
    the last use is the backward, or with a split backward its B (W works from what B hands it)."""
    done, out = self.done(), [[] for _ in range(self.p)]
    for (kind, mb, c), t in done.items():
      if kind == F and c > 0:
        out[self.device_of(c)[0]].append((done[(F, mb, c - 1)] + 1, done.get((B, mb, c), t), mb, c))
    return out

  def w_intervals(self) -> list[list[tuple[int, int, int, int]]]:
    """Per device, a split backward: (B, W, microbatch, global chunk) of each pass whose matmul inputs and output
    gradients wait from its B to its W (chunk 0's W is its whole backward: nothing waits)."""
    done, out = self.done(), [[] for _ in range(self.p)]
    for (kind, mb, c), t in done.items():
      if self.split and kind == B and c > 0:
        out[self.device_of(c)[0]].append((t, done[(W, mb, c)], mb, c))
    return out

  def grad_intervals(self) -> list[list[tuple[int, int, int, int]]]:
    """Per device: the output gradients waiting for their chunk's backward (its B; chunk 0's W with a split one)."""
    done, out, last = self.done(), [[] for _ in range(self.p)], self.chunks - 1
    for (kind, mb, c), t in done.items():
      if kind == B and c < last:
        use = W if self.split and c == 0 else B
        out[self.device_of(c)[0]].append((done[(B, mb, c + 1)] + 1, done[(use, mb, c)], mb, c))
    return out

  def in_flight(self) -> list[int]:
    """Per device: the most chunk inputs stashed at one time."""
    return [_max_overlap(iv) for iv in self.stash_intervals()]

  def passes_in_flight(self) -> list[float]:
    """Per device: the most chunk passes between their F and their last backward op at one time, in stages
    (a chunk is 1/v of a stage): the activations a backward without recompute would keep."""
    done, use = self.done(), W if self.split else B
    iv = [[] for _ in range(self.p)]
    for (kind, mb, c), t in done.items():
      if kind == F:
        iv[self.device_of(c)[0]].append((t, done[(use, mb, c)], mb, c))
    return [_max_overlap(x) / self.v for x in iv]

  def timeline(self) -> str:
    """One row per device, one cell per tick: F3 / B3 / W3 (microbatch 3), a/b/.. = local chunk, '.' idle."""
    def cell(op):
      return "." if op is None else ("FBW"[op.kind - 1] + str(op.mb) + (chr(ord("a") + op.chunk) if self.v > 1 else ""))
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
  if name in ("gpipe", "1f1b", "zb-h1") and v != 1:
    return f"pipeline.virtual_stages={v} needs pipeline.schedule=interleaved or looped-bfs ({name} runs 1 chunk per device)"
  if name == "zbv" and v != 2:
    return f"pipeline.schedule=zbv runs 2 chunks per device (a V): pipeline.virtual_stages must be 2 (got {v})"
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
  if name == "zbv":
    return _build_zbv(p, m)
  return _place(name, p, m, v, [device_order(name, p, m, v, s) for s in range(p)])


@functools.lru_cache(maxsize=16)
def build_forward(name: str, p: int, m: int, v: int = 1) -> Table:
  """Forwards only (evaluation), chunks placed as `name` places them: every microbatch through chunk 0,
  then chunk 1, ...; its Table counts no backward and stashes each input until its forward."""
  if why := check(name, p, m, v):
    raise ValueError(why)
  fwd = sorted((chunk_of(name, p, s, j), i, s, j) for s in range(p) for j in range(v) for i in range(m))
  return _place(name, p, m, v, [[Op(F, i, j) for _, i, d, j in fwd if d == s] for s in range(p)])


def _place(name, p, m, v, orders) -> Table:
  """Each device's ops in order, each at the first tick its inputs have arrived."""
  nxt, done, last, grid = [0] * p, {}, p * v - 1, []
  while any(n < len(o) for n, o in zip(nxt, orders)):
    t, row = len(grid), []
    for s in range(p):
      op = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
      if op is not None and not _ready(done, op.kind, op.mb, chunk_of(name, p, s, op.chunk), last, t):
        op = None
      row.append(op)
    if all(op is None for op in row):
      raise RuntimeError(f"schedule {name} p={p} m={m} v={v} deadlocks at tick {t}")
    for s, op in enumerate(row):
      if op is not None:
        done[(op.kind, op.mb, chunk_of(name, p, s, op.chunk))] = t
        nxt[s] += 1
    grid.append(tuple(row))
  return Table(name, p, m, v, tuple(grid))


def _ready(done, kind, mb, c, last, t) -> bool:
  """Whether op (kind, mb, global chunk c)'s inputs were there before tick t."""
  if kind == F:
    return c == 0 or done.get((F, mb, c - 1), t) < t
  if kind == W:
    return done.get((B, mb, c), t) < t
  return done.get((F, mb, c), t) < t and (c == last or done.get((B, mb, c + 1), t) < t)


def _build_zbv(p: int, m: int) -> Table:
  """ZB-V placement, greedy per tick and device: a ready B first (it is on the critical path; oldest
  microbatch, deeper chunk first), else a ready F (oldest microbatch first) while fewer than 2p chunk passes
  wait for their W (2p half-stage chunks: 1F1B's p stages of activations), else the oldest pending W."""
  last, done, grid = 2 * p - 1, {}, []
  local = [[(chunk_of("zbv", p, s, j), j) for j in range(2)] for s in range(p)]
  while len(done) < 6 * m * p:
    t, row = len(grid), []
    for s in range(p):
      waiting = sum((F, i, c) in done and (W, i, c) not in done for c, _ in local[s] for i in range(m))
      ready = [(k, i, c, j) for c, j in local[s] for i in range(m) for k in (B, F, W)
               if (k, i, c) not in done and _ready(done, k, i, c, last, t)]
      bs = sorted(((i, -c), (B, i, j)) for k, i, c, j in ready if k == B)
      fs = sorted(((i, -c), (F, i, j)) for k, i, c, j in ready if k == F and waiting < 2 * p)
      ws = sorted((done[(B, i, c)], (W, i, j)) for k, i, c, j in ready if k == W)
      row.append(Op(*(bs or fs or ws)[0][1]) if bs or fs or ws else None)
    if all(op is None for op in row):
      raise RuntimeError(f"schedule zbv p={p} m={m} deadlocks at tick {t}")
    for s, op in enumerate(row):
      if op is not None:
        done[(op.kind, op.mb, chunk_of("zbv", p, s, op.chunk))] = t
    grid.append(tuple(row))
  return Table("zbv", p, m, 2, tuple(grid))
