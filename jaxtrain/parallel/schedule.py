"""Pipeline schedules as static tables (pure Python): chunk c of the p*v lives on device c % p as local chunk
c // p (zbv, dualpipev: in a V, device d holds chunks d and 2p-1-d); a simulator places each device's ops at the
first tick their inputs have arrived. Zero-bubble schedules split the backward into B (the chunk input's gradient)
and W (the weights' gradient), W being free to fill the bubbles; dualpipev pairs one microbatch's forward with
another's backward in one tick (a `Pair`), so that the communication of each runs under the other's compute."""

from __future__ import annotations

import dataclasses
import functools

SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zbv", "dualpipev")
SPLIT = ("zb-h1", "zbv", "dualpipev")  # backward as B then W (dualpipev: or BW); elsewhere B is the whole backward
V_SHAPED = ("zbv", "dualpipev")  # two chunks per device, in a V
F, B, W, BW = 1, 2, 3, 4  # op kinds; BW: B and W at once (a split schedule's whole backward)


@dataclasses.dataclass(frozen=True)
class Op:
  kind: int  # F, B or W
  mb: int  # microbatch
  chunk: int  # local chunk index j on its device (global chunk: `Table.chunk_of`)

  def kinds(self) -> tuple[int, ...]:
    """The kinds of work it does: BW is a B and a W."""
    return (B, W) if self.kind == BW else (self.kind,)


@dataclasses.dataclass(frozen=True)
class Pair:
  """One device's two ops in one tick (dualpipev): a forward and another microbatch's backward op (B, W or BW).
  Neither needs the other, so XLA may run one's communication under the other's compute."""
  f: Op
  b: Op


def ops_of(cell) -> tuple[Op, ...]:
  """The ops of a table cell (an Op, a Pair or None)."""
  return () if cell is None else (cell.f, cell.b) if isinstance(cell, Pair) else (cell,)


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
  """The global chunk of local chunk j on device s: looped (j*p + s), or a V (s, then 2p-1-s)."""
  return (2 * p - 1 - s if j else s) if name in V_SHAPED else j * p + s


@dataclasses.dataclass(frozen=True)
class Table:
  """A placed schedule. grid[t][s] is the Op (or Pair) of device s at tick t, or None (idle)."""
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

  def ops(self):
    """(tick, device, op) of every op, both of a pair's."""
    return ((t, s, op) for t, row in enumerate(self.grid) for s, cell in enumerate(row) for op in ops_of(cell))

  @staticmethod
  def cost_of(cell, cost) -> float:
    """A cell's time: its ops one after the other on the device (a pair overlaps communication, not compute)."""
    return sum(cost[k] for op in ops_of(cell) for k in op.kinds())

  def span(self, cost=None) -> float:
    """The step's length in lock-step ticks: each tick lasts as long as its slowest cell (`cost`: {kind: seconds};
    default 1 each)."""
    cost = cost or {F: 1.0, B: 1.0, W: 1.0}
    return sum(max(self.cost_of(cell, cost) for cell in row) for row in self.grid)

  def bubble(self, cost=None) -> float:
    """Fraction of device time spent idle in lock-step ticks (`span`)."""
    cost = cost or {F: 1.0, B: 1.0, W: 1.0}
    busy = sum(self.cost_of(cell, cost) for row in self.grid for cell in row)
    return 1 - busy / (self.span(cost) * self.p)

  def bubble_formula(self) -> float:
    """Unit costs: (p-1) idle ticks per device over the v*m F and B (and W) ticks of one device. dualpipev: 5p-8
    idle units per device over its 6m (F, B, W of two half-stage chunks). Run as DeepSeek's ranks run it, each
    as soon as its inputs are there, it idles (p-1) units like zbv; in lock-step ticks, a tick lasting as long
    as its longest cell, a pair (F + B + W: 3 units) beside another device's single op costs the rest 4p-7."""
    if self.name == "dualpipev":
      return (5 * self.p - 8) / (6 * self.m + 5 * self.p - 8)
    return (self.p - 1) / ((3 if self.split else 1) * self.v * self.m + self.p - 1)

  def done(self) -> dict[tuple[int, int, int], int]:
    """{(kind, microbatch, global chunk): tick} (a BW is its B and its W at one tick)."""
    return {(k, op.mb, self.chunk_of(s, op.chunk)): t for t, s, op in self.ops() for k in op.kinds()}

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
      if self.split and kind == B and c > 0 and done[(W, mb, c)] > t:  # (a BW keeps nothing)
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
    """One row per device, one cell per tick: F3 / B3 / W3 / X3 (a whole backward in a split schedule; microbatch
    3), a/b/.. = local chunk, F1a+X0b a pair, '.' idle."""
    def cell(c):
      return "+".join("FBWX"[op.kind - 1] + str(op.mb) + (chr(ord("a") + op.chunk) if self.v > 1 else "")
                      for op in ops_of(c)) or "."
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
  if name in V_SHAPED and v != 2:
    return f"pipeline.schedule={name} runs 2 chunks per device (a V): pipeline.virtual_stages must be 2 (got {v})"
  if name in ("interleaved", "looped-bfs") and v < 2:
    return f"pipeline.schedule={name} needs pipeline.virtual_stages >= 2 (got {v}); use 1f1b or gpipe for 1"
  if m < p:
    return f"train.microbatches={m} must be >= the pipeline stages ({p}) so that every stage gets work"
  if name == "dualpipev" and m < 2 * p:
    return (f"pipeline.schedule=dualpipev pairs forwards with backwards from 2 x pipeline = {2 * p} microbatches on: "
            f"train.microbatches={m} must be >= {2 * p}")
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
  order = _dualpipev_order if name == "dualpipev" else functools.partial(device_order, name)
  return _place(name, p, m, v, [order(p, m, v, s) for s in range(p)])


@functools.lru_cache(maxsize=16)
def build_forward(name: str, p: int, m: int, v: int = 1) -> Table:
  """Forwards only (evaluation), chunks placed as `name` places them: every microbatch through chunk 0,
  then chunk 1, ...; its Table counts no backward and stashes each input until its forward."""
  if why := check(name, p, m, v):
    raise ValueError(why)
  fwd = sorted((chunk_of(name, p, s, j), i, s, j) for s in range(p) for j in range(v) for i in range(m))
  return _place(name, p, m, v, [[Op(F, i, j) for _, i, d, j in fwd if d == s] for s in range(p)])


def _place(name, p, m, v, orders) -> Table:
  """Each device's ops (or pairs) in order, each at the first tick its inputs (both ops' for a pair) have arrived."""
  nxt, done, last, grid = [0] * p, {}, p * v - 1, []
  while any(n < len(o) for n, o in zip(nxt, orders)):
    t, row = len(grid), []
    for s in range(p):
      cell = orders[s][nxt[s]] if nxt[s] < len(orders[s]) else None
      if not all(_ready(done, op.kind, op.mb, chunk_of(name, p, s, op.chunk), last, t) for op in ops_of(cell)):
        cell = None
      row.append(cell)
    if all(cell is None for cell in row):
      raise RuntimeError(f"schedule {name} p={p} m={m} v={v} deadlocks at tick {t}")
    for s, cell in enumerate(row):
      for op in ops_of(cell):
        done.update({(k, op.mb, chunk_of(name, p, s, op.chunk)): t for k in op.kinds()})
      nxt[s] += cell is not None
    grid.append(tuple(row))
  return Table(name, p, m, v, tuple(grid))


def _ready(done, kind, mb, c, last, t) -> bool:
  """Whether op (kind, mb, global chunk c)'s inputs were there before tick t."""
  if kind == F:
    return c == 0 or done.get((F, mb, c - 1), t) < t
  if kind == W:
    return done.get((B, mb, c), t) < t
  return done.get((F, mb, c), t) < t and (c == last or done.get((B, mb, c + 1), t) < t)


def _dualpipev_order(p: int, m: int, v: int, r: int) -> list:
  """Device r's work in DualPipeV (DeepSeek's DualPipe cut to one V: chunk a = stage r, chunk b = stage 2p-1-r;
  every microbatch enters at device 0's a and leaves at its b). In phases, counts per device:
  1. 2(p-1-r) forwards of a: the microbatches the V's deeper devices need before their first backward;
  2. r+1 times F a, F b; 3. p-1-r times B b, W b, F b (the backward split: its W fills the wait for the next F);
  4. the steady state, m-2p+r+1 times: F a paired with a whole backward (BW) of b, then F b with BW a;
  5. p-1-r times BW b, then F b with BW a; 6. r+1 times B b, B a, the last r+1 of these split (W later);
  7. p-1-r times a pending W, then B a split; 8. the remaining r+1 Ws. The first steady step of the turn device
  (r = p-1) runs unpaired, as its F a feeds its own b."""
  nf, nb, pending, out = [0, 0], [0, 0], [], []

  def f(j):
    nf[j] += 1
    return Op(F, nf[j] - 1, j)

  def b(j, split=False):
    nb[j] += 1
    if split:
      pending.append(Op(W, nb[j] - 1, j))
    return Op(B if split else BW, nb[j] - 1, j)

  out += [f(0) for _ in range(2 * (p - 1 - r))]
  for _ in range(r + 1):
    out += [f(0), f(1)]
  for _ in range(p - 1 - r):
    out += [b(1, split=True), pending.pop(0), f(1)]
  for i in range(m - 2 * p + r + 1):
    out += [f(0), b(1)] if i == 0 and r == p - 1 else [Pair(f(0), b(1))]
    out += [Pair(f(1), b(0))]
  for _ in range(p - 1 - r):
    out += [b(1), Pair(f(1), b(0))]
  for i in range(2 * (r + 1)):
    out += [b(1 - i % 2, split=i >= r + 1)]
  for _ in range(p - 1 - r):
    out += [pending.pop(0), b(0, split=True)]
  return out + pending


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
