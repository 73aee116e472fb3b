"""Which collectives of a compiled step overlap compute, and how much of each stays exposed.

Read from the optimized HLO: each computation lists its instructions in XLA's schedule order, so the
kernels between an async collective's start and its done are the compute it can hide behind. Times
are estimates, not measurements: a collective takes its wire bytes (ring: (n-1)/n of the larger side,
twice for an all-reduce) over the device table's link bandwidth; a kernel takes the roofline
max(FLOPs / peak, bytes / HBM bandwidth) (the FP8 peak for an FP8 GEMM, else bf16's), its FLOPs counted
from its dots, cuBLAS gemms and cuDNN attention calls (which XLA's cost analysis cannot see) and its bytes
from its operands and result.
Loop bodies count trip-count times. A conditional counts its longest branch, but a pipeline's tick switch (given
the schedule's branch per tick and device, pipeline.tick_table) counts each tick as the schedule runs it: the
devices run their own branches in lock-step (the permutes between ticks), so a tick lasts as long as the slowest.
Collectives in flight together are each credited the whole window (one link is shared), so the exposed time is a
lower bound.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np

from jaxtrain.analysis.gpu_compile import COLLECTIVES, Hlo, branches, dot_flops, operands as _operands, shape_bytes
from jaxtrain.analysis import hlo_axes
from jaxtrain.parallel import devices
from jaxtrain.analysis.gpu_compile import dims as _dims

# The predictor run on MaxText 0.2.5's own compiled program where a step time was published (tools/peer_gpu/README.md):
# Llama-2-7B, 8 H100s, bf16, 16 x 4096, predicted 0.608 s beside JAX-Toolbox's measured 0.721 s. One point, one
# device row: the factor is applied to H100 predictions only, and the result is still a prediction.
CALIBRATION = {"device": "H100", "measured_s": 0.721, "predicted_s": 0.608,
               "what": "MaxText Llama-2-7B, 8 H100s, 16 x 4096: JAX-Toolbox measured 0.721 s, predicted 0.608 s"}

_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "partition-id",
                "replica-id", "after-all", "add-dependency", "iota"}


def group_size(rest: str) -> int:
  """Devices in each replica group of a collective (1 where the text does not say)."""
  group = hlo_axes.first_group(rest)
  return len(group) if group else 1


class Costs:
  """FLOPs, bytes and roofline seconds of the kernels of one parsed module on one device row."""

  def __init__(self, hlo: Hlo, row, ticks=None, last=None):
    self.hlo, self.row = hlo, row
    self.shapes = {i.name: i.shape for i in hlo.instrs}
    self.by_comp: dict[str, list] = {}
    for i in hlo.instrs:
      self.by_comp.setdefault(i.computation, []).append(i)
    self.ticks = None if ticks is None else np.asarray(ticks)
    self.last = None if ticks is None else np.asarray(last) if last is not None else np.full(self.ticks.shape, -1)
    self.switch = self.tick_switch() if ticks is not None else None

  def tick_switch(self) -> tuple[str, str, list[str]] | None:
    """(loop body, instruction, branches) of a pipeline's tick switch: the one conditional with a branch per kind
    the table uses, in a loop of as many iterations as the table has ticks; None where there is none (CPU with
    another mesh axis computes every branch), and each conditional then counts its longest branch."""
    T, n = self.ticks.shape[0], int(self.ticks.max()) + 1
    for body, _, trip in self.hlo.loops:
      found = [i for i in self.by_comp.get(body, ()) if trip == T and i.opcode == "conditional"
               and "branch_computations" in i.rest and len(branches(i)) == n]
      if len(found) == 1:
        return body, found[0].name, branches(found[0])
    return None

  def cell(self, t: int, s: int) -> tuple[str, int]:
    """(branch computation, last) of device s at tick t."""
    return self.switch[2][self.ticks[t, s]], int(self.last[t, s])

  @functools.cached_property
  def critical(self) -> list[str]:
    """Per tick, the branch of its slowest device."""
    cells = [[self.cell(t, s) for s in range(self.ticks.shape[1])] for t in range(self.ticks.shape[0])]
    return [max(row, key=lambda c: self.run_seconds(*c))[0] for row in cells]

  def pick(self, i, last: int) -> str:
    """The branch of a tick branch's own predicated conditional (the model's last chunk's head terms: the longer
    branch) on a device whose op runs the last chunk (1), does not (0, the shorter) or both in a pair (-1)."""
    return min(branches(i), key=self.computation) if last == 0 else self.branch(i)

  @functools.lru_cache(maxsize=None)
  def run_seconds(self, name: str, last: int) -> float:
    """Time of one run of a tick branch, its head terms counted as `last` says (`pick`)."""
    return sum(self.computation(self.pick(i, last)) if _predicated(i) else self.seconds(i)
               for i in self.by_comp.get(name, ()))

  @functools.lru_cache(maxsize=None)
  def run_matmuls(self, name: str, last: int, stage: int) -> float:
    return sum(self.matmuls(self.pick(i, last), stage) if _predicated(i) else self.matmul_flops(i, stage)
               for i in self.by_comp.get(name, ()))

  def tick_loop(self, body: str, trip: int, cost) -> float | None:
    """A cost of the tick loop as the schedule runs it, None for another loop: every tick the body's instructions
    but the switch (cost(instruction)), and the tick's switch part (cost(None, tick))."""
    if self.switch is None or body != self.switch[0]:
      return None
    rest = [j for j in self.by_comp[body] if j.name != self.switch[1]]
    return trip * sum(cost(j) for j in rest) + sum(cost(None, t) for t in range(trip))

  def share(self, comp: str) -> float:
    """The part of the step's executions of `comp` its time counts: all (1), or under a tick switch's branches
    those of the ticks whose slowest device runs such a branch."""
    under = [b for b in self.switch[2] if comp in self.reached(b)] if self.switch else []
    return sum(map(self.critical.count, under)) / len(self.critical) if under else 1

  @functools.lru_cache(maxsize=None)
  def reached(self, comp: str) -> frozenset[str]:
    """The computations `comp` runs, itself included."""
    out = {comp}
    for i in self.by_comp.get(comp, ()):
      for c in branches(i) + ([self.loop(i)[0]] if i.opcode == "while" else []):
        out |= self.reached(c)
    return frozenset(out)

  def flops(self, i) -> float:
    """Matmul FLOPs of one instruction: a dot, a fusion's dots, a cuBLAS gemm or a cuDNN attention call."""
    if i.opcode == "dot":
      return dot_flops(i, self.shapes)
    if i.opcode == "fusion":
      callee = re.search(r"calls=%?([\w.\-]+)", i.rest)
      return sum(self.flops(j) for j in self.by_comp.get(callee.group(1), ())) if callee else 0.0
    target = re.search(r'custom_call_target="([^"]+)"', i.rest)
    if i.opcode != "custom-call" or not target:
      return 0.0
    if target.group(1).startswith("__cublas"):
      return dot_flops(i, self.shapes)
    if target.group(1).startswith("__cudnn$fmha"):
      q, k = (_dims(self.shapes.get(o, "")) for o in _operands(i)[:2])
      shared = [x for x in q[:-1] if x in k[:-1]]  # self-attention: the sequence is the largest shared dim
      fwd = 4.0 * math.prod(q) * (max(shared) if shared else 1)  # QK^T and PV, dense (causal mask not halved)
      return fwd * 2.5 if "Backward" in target.group(1) else fwd
    return 0.0

  @staticmethod
  def loop(i) -> tuple[str, int]:
    """(body, trip count) of a while instruction."""
    body, trip = re.search(r"body=%?([\w.\-]+)", i.rest).group(1), re.search(r'"n":"(\d+)"', i.rest)
    return body, int(trip.group(1)) if trip else 1

  def branch(self, i) -> str | None:
    """The callee a call runs, or the longest branch of a conditional (a pipeline tick's stage work): what both
    the step's time and its matmul FLOPs count."""
    return max(branches(i), key=self.computation, default=None)

  def seconds(self, i) -> float:
    """Roofline time of one scheduled instruction; a loop: its body's time x trip count."""
    if i.opcode == "while":
      body, trip = self.loop(i)
      ticks = self.tick_loop(body, trip, lambda j, t=None: self.seconds(j) if j else max(
          self.run_seconds(*self.cell(t, s)) for s in range(self.ticks.shape[1])))
      return self.computation(body) * trip if ticks is None else ticks
    if i.opcode in ("call", "conditional"):  # one branch runs: the longest
      b = self.branch(i)
      return self.computation(b) if b else 0.0
    if i.opcode in _NOT_KERNELS or i.opcode.endswith(("-start", "-done", "-update")) or i.opcode in COLLECTIVES:
      return 0.0
    return max(self.flops(i) / self.peak(i), self.nbytes(i) / self.row.bandwidth)

  def peak(self, i) -> float:
    """The row's FP8 peak for an FP8 GEMM (a cuBLASLt FP8 call, a fusion or dot reading f8), else bf16's."""
    fp8 = ('$f8"' in i.rest or any(self.shapes.get(o, "").startswith("f8") for o in _operands(i))) and bool(
        self.flops(i))
    return (self.row.peak_fp8_flops or self.row.peak_bf16_flops) if fp8 else self.row.peak_bf16_flops

  def nbytes(self, i) -> int:
    """HBM bytes of a kernel: operands and result, but of an operand the fusion only slices (a scanned
    layer's slice of stacked weights or saved activations) the slices, and of an in-place update the update."""
    ops = _operands(i)
    callee = re.search(r"calls=%?([\w.\-]+)", i.rest) if i.opcode == "fusion" else None
    body = self.by_comp.get(callee.group(1), []) if callee else []
    if not body:
      return shape_bytes(i.shape) + sum(shape_bytes(self.shapes.get(o, "")) for o in ops)
    root, total = body[-1], 0
    in_place = root.opcode == "dynamic-update-slice"
    for p in (j for j in body if j.opcode == "parameter"):
      k = int(p.rest.split(")", 1)[0])
      users = [u for u in body if p.name in _operands(u)]
      if users and all(u.opcode in ("dynamic-slice", "slice") for u in users):
        total += sum(shape_bytes(u.shape) for u in users)
      elif not (in_place and users == [root] and _operands(root)[0] == p.name) and k < len(ops):
        total += shape_bytes(self.shapes.get(ops[k], ""))
    update = _operands(root)[1] if in_place and len(_operands(root)) > 1 else None
    return total + (shape_bytes(self.shapes.get(update, "")) if update else shape_bytes(i.shape))

  @functools.lru_cache(maxsize=None)
  def computation(self, name: str) -> float:
    return sum(self.seconds(i) for i in self.by_comp.get(name, ()))

  @functools.lru_cache(maxsize=None)
  def matmuls(self, name: str, stage: int = 0) -> float:
    """Matmul FLOPs of one run of a computation on pipeline stage `stage`, counted as its time is: a loop's body x
    trip count (the tick loop: each tick's branch of that stage), a call's or conditional's longest branch only, an
    async computation's work."""
    total = 0.0
    for i in self.by_comp.get(name, ()):
      total += self.matmul_flops(i, stage)
    return total

  def matmul_flops(self, i, stage: int) -> float:
    if i.opcode == "while":
      body, trip = self.loop(i)
      ticks = self.tick_loop(body, trip, lambda j, t=None: self.matmul_flops(j, stage) if j else self.run_matmuls(
          *self.cell(t, stage), stage))
      return self.matmuls(body, stage) * trip if ticks is None else ticks
    if i.opcode in ("call", "conditional"):
      b = self.branch(i)
      return self.matmuls(b, stage) if b else 0.0
    if i.opcode == "async-start":
      return sum(self.matmuls(c, stage) for c in branches(i))
    return self.flops(i) if i.opcode in ("fusion", "custom-call", "dot") else 0.0


def _predicated(i) -> bool:
  return i.opcode == "conditional" and "true_computation" in i.rest


def _kind_and_bytes(i, shapes, roots) -> tuple[str, int] | None:
  """(collective kind, larger side in bytes) as gpu_compile.collectives counts it; None if no collective."""
  kind = i.opcode.removesuffix("-start")
  if i.opcode == "async-start":
    callee = re.search(r"calls=%?([\w.\-]+)", i.rest)
    kind = roots.get(callee.group(1), "") if callee else ""
  if kind not in COLLECTIVES or i.opcode.endswith("-done"):
    return None
  ins = sum(shape_bytes(shapes.get(o, "")) for o in _operands(i))
  res = shape_bytes(i.shape)
  return kind, (max(ins, res - ins) if i.opcode.endswith("-start") and res > ins else max(ins, res))


def report(hlo: Hlo, row=None, ticks=None, last=None) -> dict:
  """Every collective of the step with its async flag, bytes, the compute scheduled under it and (with a
  device row that has link and HBM bandwidths and a peak) its estimated and exposed seconds; totals per
  step; per loop, whether its all-gathers overlap the body's compute (FSDP prefetch of the next layer).
  `ticks`, `last`: a pipelined step's tick switch branch and head terms per (tick, stage) (pipeline.tick_table)."""
  timed = row is not None and all(getattr(row, f, None) for f in ("link_bandwidth", "bandwidth", "peak_bf16_flops"))
  costs = Costs(hlo, row, ticks, last) if timed else None
  shapes = {i.name: i.shape for i in hlo.instrs}
  roots = {i.computation: i.opcode for i in hlo.instrs}  # a computation's last instruction is its ROOT
  order: dict[str, list] = {}
  for i in hlo.instrs:
    order.setdefault(i.computation, []).append(i)
  rows = []
  for comp, seq in order.items():
    for p, i in enumerate(seq):
      kb = _kind_and_bytes(i, shapes, roots)
      if kb is None:
        continue
      kind, nbytes = kb
      n = group_size(i.rest)
      wire = nbytes * (n - 1) / n * (2 if kind == "all-reduce" else 1) if kind != "collective-permute" else nbytes
      is_async = i.opcode.endswith("-start") and '"is_sync":true' not in i.rest
      # the kernels up to its done; a start handed to the next iteration (ROOT) overlaps the rest of this one
      carried = len(seq) if i.name in _operands(seq[-1]) else p
      q = next((k for k in range(p + 1, len(seq)) if i.name in _operands(seq[k]) and seq[k].opcode.endswith("-done")),
               carried) if is_async else p
      under = [j for j in seq[p + 1:q] if j.opcode in ("fusion", "custom-call", "dot", "while", "call", "conditional")]
      r = {"name": i.name, "kind": kind, "computation": comp, "per_step": hlo.times.get(comp, 1), "async": is_async,
           "bytes": nbytes, "group": n, "wire_bytes": int(wire), "kernels_under": len(under),
           "kernels_under_names": [j.name for j in under[:4]]}
      if costs:
        t, hidden = wire / row.link_bandwidth, sum(costs.seconds(j) for j in under)
        r.update(seconds=t, overlapped_seconds=min(t, hidden), exposed_seconds=max(0.0, t - hidden),
                 flops_under=sum(costs.flops(j) for j in under), timed_per_step=r["per_step"] * costs.share(comp))
      rows.append(r)
  out = {"collectives": rows, "per_kind": {}}
  for k in COLLECTIVES:
    mine = [r for r in rows if r["kind"] == k]
    if mine:
      out["per_kind"][k] = {f: sum(r[f] * r["per_step"] for r in mine) for f in ("bytes", "wire_bytes")}
      out["per_kind"][k].update({f: sum(r[f] * r["timed_per_step"] for r in mine) for f in (
          ("seconds", "exposed_seconds") if costs else ())})
      out["per_kind"][k].update(ops=len(mine), asynchronous=sum(r["async"] for r in mine))
  out["loops"] = _loops(hlo, rows, order, costs)
  if costs:
    out["totals"] = _totals(hlo, costs, rows, row)
  return out


def _loops(hlo: Hlo, rows: list[dict], order: dict, costs) -> list[dict]:
  """Per scanned loop with all-gathers: how many are async, have compute under them, fetch the next iteration's."""
  loops = []
  for body, _, trip in hlo.loops:
    ags = [r for r in rows if r["computation"] == body and r["kind"] == "all-gather"]
    if trip > 1 and ags:
      # prefetch: a gathered result handed to the next iteration (the ROOT tuple), so layer i+1's
      # weights arrive under layer i; otherwise each layer gathers its own weights as it goes
      root = _operands(order[body][-1])
      carried = set(root) | {i.name for i in order[body] if i.opcode in ("bitcast", "copy") and _operands(i)[0] in root}
      dones = {j.name: _operands(j)[0] for j in order[body] if j.opcode.endswith("-done") and _operands(j)}
      loop = {"body": body, "trip": trip, "all_gathers": len(ags), "async": sum(r["async"] for r in ags),
              "with_compute_under": sum(r["kernels_under"] > 0 for r in ags),
              "next_iteration_prefetched": sum(dones.get(d) in {r["name"] for r in ags} for d in carried)
              + sum(r["name"] in root for r in ags)}
      if costs:
        t = sum(r["seconds"] for r in ags)
        loop.update(hidden_fraction=sum(r["overlapped_seconds"] for r in ags) / t if t else 1.0,
                    matmuls_under=sum(r["flops_under"] > 0 for r in ags))
      loops.append(loop)
  return loops


def _totals(hlo: Hlo, costs: Costs, rows: list[dict], row) -> dict:
  """The step's predicted seconds (compute + exposed communication), matmul FLOPs, and on an H100 the prediction
  calibrated by the peer's measured/predicted (CALIBRATION)."""
  entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo.text, re.M).group(1)
  compute = costs.computation(entry)
  exposed = sum(r["exposed_seconds"] * r["timed_per_step"] for r in rows)
  out = {
      "collective_seconds": sum(r["seconds"] * r["timed_per_step"] for r in rows), "exposed_seconds": exposed,
      "compute_seconds": compute, "predicted_step_seconds": compute + exposed,
      "matmul_flops": costs.matmuls(entry),
      "label": "prediction, not a measurement: kernels at their roofline one after another, plus the exposed "
               "part of each collective at the link bandwidth"}
  if costs.ticks is not None:  # whether the schedule's ticks were found in the program (else: longest branches)
    out["pipeline_ticks_counted"] = costs.switch is not None
  if costs.switch:  # per device: each stage's own branches; the mean is the step's FLOPs over the devices
    per_stage = [costs.matmuls(entry, s) for s in range(costs.ticks.shape[1])]
    out.update(matmul_flops=sum(per_stage) / len(per_stage), matmul_flops_per_stage=per_stage,
               label=out["label"] + "; a pipeline's ticks as its schedule runs them, each as its slowest device's")
  if row == devices.TABLE[CALIBRATION["device"]]:
    factor = CALIBRATION["measured_s"] / CALIBRATION["predicted_s"]
    out.update(calibrated_step_seconds=(compute + exposed) * factor, calibration=CALIBRATION)
  return out
