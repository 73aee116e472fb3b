"""The planner: every layout of a model on N devices that can run, pruned by the config's own refusals and the
memory bill, ranked by an analytic step time, the most promising compiled for the target (XLA:GPU without a GPU)
and re-ranked by the compiled step's predicted time (analysis.overlap, calibrated on an H100).

A layout is a mesh (tensor inside a host, expert inside or across hosts; pipeline, data, fsdp and sequence across)
with the options that trade memory for time: model.remat, train.microbatches, optim.zero_stage,
run.sequence_parallel and the pipeline schedule. docs/planner.md has the search and the figures it gives.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time

from jaxtrain.analysis import comms, fit, memory, report
from jaxtrain.core import config as config_lib
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import devices
from jaxtrain.parallel import mesh as mesh_lib

REMATS = ("none", "save_dots", "save_named", "full")  # least recompute first
# Forward passes per step beyond the one of the loss, as a fraction of the 3 (fwd + 2 bwd) of a step: an estimate
# for the analytic ranking only (save_dots recomputes attention's core, save_named the MLP's activation and norms).
RECOMPUTE = {"none": 0.0, "save_dots": 0.05, "save_named": 0.1, "full": 1 / 3}
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
DCN_BANDWIDTH = 50e9  # bytes/s one way per GPU across hosts: one 400 Gb/s NIC per GPU (H100/H200 HGX pods)
LONG_SEQUENCE = 8192  # from this length a sequence axis (ring or Ulysses attention) is tried
MARGIN = 0.10  # inspect's default margin of the bill


@dataclasses.dataclass(frozen=True)
class Target:
  """What the plan is for: the device kind, how many, how many per host ('cpu': this host's CPU, simulated
  devices, all on the one host)."""
  device: str
  gpus: int
  per_host: int

  @property
  def cpu(self) -> bool:
    return self.device.lower() == "cpu"

  @property
  def hosts(self) -> int:
    return 1 if self.cpu else max(1, self.gpus // self.per_host)


def cpu_row(count: int) -> devices.Device:
  """A device-table row for one of `count` simulated CPU devices of this host, measured here: they share the host's
  cores and memory, so each gets 1/count of its bf16 matmul rate, of its copy bandwidth (a kernel's bytes and, in one
  process, a collective's too) and of its RAM. Needs the devices provided before the backend starts."""
  import os
  import jax
  import jax.numpy as jnp
  from jaxtrain.analysis import speed
  here = jax.devices("cpu")
  if len(here) < count:
    raise UserError(f"--device cpu --gpus {count}: this process has {len(here)} CPU device(s) (XLA_FLAGS or "
                    f"JAX_NUM_CPU_DEVICES fixed the count); plan for at most {len(here)} or unset them")
  dev = here[0]
  flops = speed.measure_peak(dev, size=512, reps=3)["flops"]
  x = jax.device_put(jnp.ones((16 * 2**20,), jnp.float32), dev)  # 64 MiB: beyond the caches
  copy = jax.jit(lambda a: a + 1)
  copy(x).block_until_ready()
  best = min(_timed(lambda: copy(x).block_until_ready()) for _ in range(3))
  bandwidth = 2 * x.nbytes / best  # read and write
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return devices.Device(flops / count, ram // count, bandwidth / count, None, bandwidth / count)


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


@dataclasses.dataclass(frozen=True)
class Layout:
  sizes: tuple[tuple[str, int], ...]  # (axis, size) of the six axes, mesh order
  dcn: tuple[tuple[str, int], ...]    # (axis, cross-host factor)
  remat: str = "none"
  microbatches: int = 1
  zero_stage: int = 0
  sequence_parallel: bool = False
  schedule: str = "1f1b"
  virtual_stages: int = 1

  @property
  def axes(self) -> dict[str, int]:
    return dict(self.sizes)

  def mesh_spec(self) -> str:
    """The layout's mesh in --mesh syntax, cross-host factors included."""
    inner = [f"{a}={s}" for a, s in self.sizes if s > 1] or ["fsdp=1"]
    return ",".join(inner + [f"dcn.{a}={k}" for a, k in self.dcn if k > 1])

  def overrides(self) -> list[str]:
    """The --set items of the layout (the pipeline's only with a pipeline axis)."""
    out = [f"model.remat={self.remat}", f"train.microbatches={self.microbatches}", f"optim.zero_stage={self.zero_stage}",
           f"run.sequence_parallel={str(self.sequence_parallel).lower()}"]
    if self.axes["pipeline"] > 1:
      out += [f"pipeline.schedule={self.schedule}", f"pipeline.virtual_stages={self.virtual_stages}"]
    return out

  def label(self) -> str:
    opts = [f"remat {self.remat}", f"mb {self.microbatches}"]
    opts += [f"zero{self.zero_stage}"] if self.zero_stage else []
    opts += ["sp"] if self.sequence_parallel else []
    if self.axes["pipeline"] > 1:
      opts.append(self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""))
    return f"{mesh_lib.describe(self.axes)} | {' '.join(opts)}"

  def preset(self, description: str) -> str:
    """The mesh as a preset TOML (meshes/*.toml), loadable with --mesh PATH."""
    lines = [f"description = {description!r}".replace("'", '"'), "[axes]"]
    lines += [f"{a} = {s}" for a, s in self.sizes if s > 1] or ["fsdp = 1"]
    if any(k > 1 for _, k in self.dcn):
      lines += ["[dcn]", *(f"{a} = {k}" for a, k in self.dcn if k > 1)]
    return "\n".join(lines) + "\n"


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def cross_host(sizes: dict[str, int], target: Target) -> dict[str, int] | None:
  """Each axis's cross-host factor: an expert axis larger than its share of a host (tensor's rest) crosses with the
  rest; the hosts left split over pipeline, data, sequence, then fsdp (the axes whose traffic is least or best hidden
  cross the network first); tensor stays inside a host. None: no even split."""
  dcn = {a: 1 for a in mesh_lib.AXES}
  inner = max(1, min(target.per_host, target.gpus) // sizes["tensor"])
  dcn["expert"] = sizes["expert"] // math.gcd(sizes["expert"], inner)
  left = target.hosts // dcn["expert"] if target.hosts % dcn["expert"] == 0 else 0
  for axis in ("pipeline", "data", "sequence", "fsdp"):
    dcn[axis] = math.gcd(left, sizes[axis])
    left //= max(1, dcn[axis])
  return dcn if left == 1 else None


def expert_sizes(cfg, inner: int, hosts: int) -> list[int]:
  """Expert-parallel degrees of an MoE model beside a tensor axis that leaves `inner` devices of a host: dividing
  `inner`, or all of it times a number of hosts (expert parallelism across hosts, as DeepSeek-V3 trained: EP 64 over
  8 nodes: the all-to-all crosses the network, but each device keeps its experts' weights instead of gathering them
  over fsdp every step). Each divides model.moe_experts. [1] for a dense model."""
  x = cfg.model.moe_experts
  if not x:
    return [1]
  sizes = divisors(inner) + [inner * h for h in divisors(hosts) if h > 1]
  return [e for e in sizes if x % e == 0]


def sequence_sizes(cfg, rest: int, gpus: int) -> list[int]:
  """Sequence-axis degrees dividing `rest`: up to seq_len / 8192 for long sequences, or where the batch has fewer
  sequences than there are GPUs, up to the split that gives each GPU a part of one (DeepSeek-V3's 256 x 4096 on 512
  GPUs: half a sequence each)."""
  t = cfg.train
  most = max(t.seq_len // LONG_SEQUENCE, -(-gpus // t.batch_size))
  return [s for s in divisors(rest) if s <= most and t.seq_len % s == 0] or [1]


def meshes(cfg, target: Target):
  """Every mesh of `target.gpus` devices: tensor dividing a host, expert its rest of the host or across hosts
  (expert_sizes); pipeline where the layers split evenly; sequence for long sequences or a short batch; data x fsdp
  the rest."""
  m = cfg.model
  per_host = min(target.per_host, target.gpus)
  for tensor in divisors(per_host):
    for expert in expert_sizes(cfg, per_host // tensor, target.hosts):
      rest = target.gpus // (tensor * expert)
      if target.gpus % (tensor * expert):
        continue
      pipes = [p for p in divisors(rest) if p == 1 or (m.n_layers % p == 0 and p <= m.n_layers)]
      for pipeline in pipes:
        for sequence in sequence_sizes(cfg, rest // pipeline, target.gpus):
          for fsdp in divisors(rest // pipeline // sequence):
            data = rest // (pipeline * sequence * fsdp)
            sizes = dict(pipeline=pipeline, data=data, fsdp=fsdp, expert=expert, sequence=sequence, tensor=tensor)
            dcn = cross_host(sizes, target)
            if dcn is not None:
              yield sizes, dcn


def structures(cfg, sizes: dict[str, int]):
  """(zero_stage, sequence_parallel, schedule, virtual_stages) worth trying on a mesh: ZeRO only with data > 1,
  sequence parallelism only with tensor > 1, a schedule only with a pipeline."""
  zeros = (0, 1, 2) if sizes["data"] > 1 else (0,)
  sps = (False, True) if sizes["tensor"] > 1 else (False,)
  scheds = [(s, v) for s, v in SCHEDULES] if sizes["pipeline"] > 1 else [("1f1b", 1)]
  p = sizes["pipeline"]
  if p > 1:  # interleaved also at more chunks per device, where the layers divide (Megatron's VP5 on 80 layers)
    scheds += [("interleaved", v) for v in range(3, 9) if cfg.model.n_layers % (p * v) == 0]
  return list(itertools.product(zeros, sps, scheds))


def splits(cfg, sizes: dict[str, int]) -> list[int]:
  """Microbatch counts to try: those that leave each microbatch divisible over the batch axes; with a pipeline,
  1x to 8x the stages and one sequence per device and microbatch (Megatron's usual split), else 1 to 8."""
  t, ways = cfg.train, sizes["data"] * sizes["fsdp"] * sizes["expert"]
  p = sizes["pipeline"]
  tries = sorted({p, 2 * p, 4 * p, 8 * p, t.batch_size // ways}) if p > 1 else [1, 2, 4, 8]
  return [k for k in tries if k >= 1 and t.batch_size % k == 0 and (t.batch_size // k) % ways == 0]


def candidates(cfg, target: Target):
  """Every layout, grouped: (mesh sizes, dcn, [layouts of that mesh, least memory last within each structure])."""
  for sizes, dcn in meshes(cfg, target):
    group = []
    for zero, sp, (sched, vs) in structures(cfg, sizes):
      for remat, k in itertools.product(REMATS, splits(cfg, sizes)):
        group.append(Layout(tuple(sizes.items()), tuple(dcn.items()), remat, k, zero, sp, sched, vs))
    if group:
      yield sizes, dcn, group


@dataclasses.dataclass
class Result:
  """A layout that can run: its bill, the analytic estimate, and once compiled, what XLA says."""
  layout: Layout
  bill: int                      # bytes per device, the bill with inspect's margin
  estimate: dict                 # analytic: compute_s, exposed_s, step_s
  compiled: dict | None = None   # total (bytes), seconds (compile), step_s, exposed_s, calibrated, fits

  @property
  def step_s(self) -> float:
    return self.compiled["step_s"] if self.compiled else self.estimate["step_s"]

  @property
  def memory(self) -> int:
    return self.compiled["total"] if self.compiled else self.bill

  @property
  def exposed_s(self) -> float:
    return self.compiled["exposed_s"] if self.compiled else self.estimate["exposed_s"]


@dataclasses.dataclass
class Outcome:
  """The plan: the ranked layouts that can run, and what was pruned (reason -> count)."""
  target: Target
  config: str
  results: list[Result]
  refused: dict[str, int]
  over_memory: int
  enumerated: int
  seconds: float = 0.0
  row: devices.Device | None = None  # the device's row (for the CPU: measured on this host)
  compile_notes: list[str] = dataclasses.field(default_factory=list)
  flops_per_step: float = 0.0
  tokens_per_step: int = 0


class Evaluator:
  """Builds each layout's Setup on the target's mesh (meshes and the abstract model cached) and bills it."""

  def __init__(self, name: str, overrides: list[str], target: Target):
    self.name, self.overrides, self.target = name, list(overrides), target
    if target.cpu:  # simulated CPU devices, asked for before the backend starts; the row measured on them
      mesh_lib.provide_cpu_devices(target.gpus)
      self.row = cpu_row(target.gpus)
    else:
      self.row = devices.TABLE[devices.of(target.device).key]
    self.capacity = self.row.memory_bytes
    self._meshes: dict[str, object] = {}
    self._abstracts: dict = {}  # the abstract model and train state, traced once per config (run.step.Setup)
    self._segments: list = []  # the data's segments per row (the attention path), counted once: no layout moves it

  def mesh(self, layout: Layout):
    spec = layout.mesh_spec()
    if spec not in self._meshes:
      self._meshes[spec] = (mesh_lib.build(layout.axes, self._cpus()) if self.target.cpu else
                            report.target_mesh(self.target.device, spec, False, None)[0])
    return self._meshes[spec]

  def _cpus(self) -> list:
    """The first --gpus CPU devices of this process (it may hold more: a test's, a user's XLA_FLAGS)."""
    import jax
    return jax.devices("cpu")[:self.target.gpus]

  def setup(self, layout: Layout):
    """The layout's Setup, or the UserError line the config, the mesh checks or the plan refuse it with."""
    from jaxtrain.run import step as step_lib
    cfg = config_lib.load(self.name, [*self.overrides, *layout.overrides()])
    if not self._segments:
      self._segments.append(report.data_segments(cfg))
    return step_lib.Setup(cfg, self.mesh(layout), segments=self._segments[0], abstracts=self._abstracts)

  def bill(self, setup) -> tuple[int, list]:
    """(bytes per device with inspect's margin, the compute-layout rows) for the target device's kernels."""
    from jaxtrain.parallel import plan as plan_lib
    rows = memory.grouped(memory.param_rows(setup))
    b = memory.bill(setup, rows, MARGIN, plan=plan_lib.build(setup.cfg, setup.mesh, device=self.target.device,
                                                             segments=self._segments[0]))
    return b.total, rows

  def fits(self, total: int) -> bool:
    return fit.verdict(total, self.capacity)[0] is not False


def overlapped(axis: str, what: str) -> bool:
  """Traffic XLA overlaps with the layers' compute: fsdp's, and the same per-layer weight gathers and gradient
  reduce-scatters over `expert` (the dense weights stored split over fsdp x expert)."""
  return axis == "fsdp" or (axis == "expert" and what in ("param all-gather (fwd+bwd)", "grad reduce-scatter"))


def estimate(setup, rows, layout: Layout, row) -> dict:
  """Analytic step time: the model FLOPs (with remat's recompute) at the peak, stretched by the pipeline's bubble;
  the communication of each axis at NVLink or network bandwidth, all exposed but what XLA overlaps with the layers'
  compute (`overlapped`), hidden up to the compute's length. A bound to rank by (kernels
  at their peak), not a prediction."""
  from jaxtrain.model import flops
  from jaxtrain.parallel import pipeline
  cfg, mesh = setup.cfg, setup.mesh
  per_step = flops.flops_per_token(cfg.model, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
  compute = per_step / mesh.size * (1 + RECOMPUTE[layout.remat]) / row.peak_bf16_flops
  if pipeline.active(mesh):
    compute /= 1 - pipeline.table(cfg, mesh).bubble_formula()
  dcn = dict(layout.dcn)
  exposed = hidden = 0.0
  for axis, parts in comms.traffic(cfg, mesh, rows).items():
    bandwidth = DCN_BANDWIDTH if dcn.get(axis, 1) > 1 else row.link_bandwidth
    for what, n in parts.items():
      if overlapped(axis, what):
        hidden += n / bandwidth
      else:
        exposed += n / bandwidth
  exposed += max(0.0, hidden - compute)
  return {"compute_s": compute, "exposed_s": exposed, "step_s": compute + exposed, "flops_per_step": per_step}


def _try(ev: Evaluator, layout: Layout, refused: dict[str, int]):
  """(Result, None) for a layout that runs and fits; (None, 'refused' or 'over')."""
  try:
    setup = ev.setup(layout)
  except UserError as e:
    key = memory.generic_path(str(e))
    refused[key] = refused.get(key, 0) + 1
    return None, "refused"
  total, rows = ev.bill(setup)
  if not ev.fits(total):
    return None, "over"
  return Result(layout, total, estimate(setup, rows, layout, ev.row)), None


def evaluate_group(ev: Evaluator, group: list[Layout], refused: dict[str, int]) -> tuple[list[Result], int]:
  """The layouts of one mesh that can run and fit, and how many were over memory. Per structure (ZeRO, sequence
  parallelism, schedule) the least-memory layout (full remat, most microbatches) is tried first: where it is
  refused or over memory, so is the structure. Then per remat policy (most recompute first, stopping at one that
  cannot fit with the most microbatches) its fewest microbatches that fit (more only split the same work); with a
  pipeline every count that fits (more microbatches, a smaller bubble)."""
  out, over = [], 0
  by_structure = itertools.groupby(group, key=lambda l: (l.zero_stage, l.sequence_parallel, l.schedule,
                                                         l.virtual_stages))
  for _, layouts in by_structure:
    by_remat = {r: list(ls) for r, ls in itertools.groupby(layouts, key=lambda l: l.remat)}
    for remat in reversed(REMATS):
      tries = by_remat.get(remat, [])
      if not tries:
        continue
      first, why = _try(ev, tries[-1], refused)
      if why:  # the remat policies with less recompute need more memory still (or are refused alike)
        over += sum(len(ls) for r, ls in by_remat.items() if REMATS.index(r) <= REMATS.index(remat)) if (
            why == "over") else 0
        break
      found = [first]
      for layout in tries[:-1]:
        r, why = _try(ev, layout, refused)
        over += why == "over"
        if r is not None:
          found = [r] if layout.axes["pipeline"] == 1 else [*found, r]
          if layout.axes["pipeline"] == 1:
            break
      out += found
  return out, over


def can_compile(device: str) -> str | None:
  """None where XLA:GPU can compile for `device` here, else why not (one line)."""
  from jaxtrain.analysis import gpu_compile
  if device.lower() == "cpu":
    return None  # XLA:CPU, the backend of this process
  if gpu_compile.target(device) is None:
    return f"no XLA:GPU compile target for {device} (targets: {', '.join(gpu_compile.TARGETS.values())})"
  if not gpu_compile.plugin_installed():
    return "no CUDA plugin installed (pip install 'jaxtrain[gpu-aot]'): XLA's GPU compiler is not here"
  return None


def compile_layout(ev: Evaluator, layout: Layout) -> dict:
  """XLA:GPU's compile of the layout's step: its memory per device and the overlap report's predicted step
  (calibrated where the device has a calibration, analysis.overlap.CALIBRATION), a pipeline's ticks counted as its
  schedule runs them. A prediction below the model FLOPs at the peak cannot be: a guard, that bound replaces it
  (kernels the report cannot see)."""
  from jaxtrain.analysis import gpu_compile, overlap
  from jaxtrain.parallel import pipeline
  setup = ev.setup(layout)
  compiled, seconds = gpu_compile.compile_step(setup)
  text = compiled.as_text()
  m = gpu_compile.CompiledMemory.of(compiled)
  tot = overlap.report(gpu_compile.Hlo.parse(text), ev.row, **pipeline.tick_table(setup.cfg, setup.mesh))["totals"]
  total = (m.total if m else 0) - report.host_argument_bytes(text)
  step = tot.get("calibrated_step_seconds", tot["predicted_step_seconds"])
  floor = estimate(setup, memory.grouped(memory.param_rows(setup)), layout, ev.row)["compute_s"]
  return {"total": total, "seconds": seconds, "fits": ev.fits(total), "exposed_s": tot["exposed_seconds"],
          "step_s": max(step, floor), "floored": step < floor, "calibrated": "calibrated_step_seconds" in tot}


def compile_best(ev: Evaluator, out: Outcome, top: int, deadline: float, progress: bool) -> None:
  """Compiles the `top` best of the analytic ranking, one after another, while the next compile is expected to
  end before `deadline` (perf_counter seconds); a layout XLA's memory analysis puts over memory leaves the table."""
  import tqdm
  todo, durations, failed = out.results[:top], [], []
  bar = tqdm.tqdm(todo, desc="compiling", unit="layout", file=sys.stderr, disable=not progress, leave=False)
  for r in bar:
    expected = max(durations, default=0.0)
    if time.perf_counter() + expected > deadline:
      out.compile_notes.append(f"time budget reached: {len(durations)} of {len(todo)} layouts compiled")
      break
    bar.set_postfix_str(r.layout.label(), refresh=True)
    if not progress:  # no bar (not a terminal): one line per compile, for a log that shows where the time goes
      print(f"compiling {len(durations) + 1}/{len(todo)}: {r.layout.label()}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
      r.compiled = compile_layout(ev, r.layout)
    except Exception as e:  # noqa: BLE001 - XLA's errors are many types; a layout that does not compile is out
      failed.append(r)
      out.compile_notes.append(f"{r.layout.label()}: XLA:GPU did not compile it ({type(e).__name__}: "
                               f"{(str(e).splitlines() or [''])[0][:160]}); left out")
    durations.append(time.perf_counter() - start)
  bar.close()
  out.results = [r for r in out.results if r not in failed]
  over = [r for r in out.results if r.compiled and not r.compiled["fits"]]
  out.over_memory += len(over)
  if over:
    out.compile_notes.append(f"{len(over)} compiled layout(s) over memory by XLA's analysis (the bill had them in)")
  out.results = [r for r in out.results if not (r.compiled and not r.compiled["fits"])]


def rank(r: Result) -> tuple:
  """Compiled first; then the shorter step, at a tie (communication-bound) the less compute, then less memory."""
  return r.compiled is None, r.step_s, r.estimate["compute_s"], r.memory


def plan(name: str, overrides: list[str], target: Target, *, compile_top: int = 8, budget_s: float = 900.0,
         progress: bool = True) -> Outcome:
  """Enumerates, prunes, ranks; compiles the best `compile_top` for the target within `budget_s` seconds (all of
  the plan's time); the compiled ones first (by predicted step), then the rest (by the analytic estimate)."""
  import tqdm
  t0 = time.perf_counter()
  base = config_lib.load(name, overrides)  # a bad --set stops here, in one line
  ev = Evaluator(name, overrides, target)
  out = Outcome(target, config_lib.run_name(name), [], {}, 0, 0, row=ev.row,
                tokens_per_step=base.train.batch_size * base.train.seq_len)
  for _, _, group in tqdm.tqdm(list(candidates(base, target)), desc="pruning", unit="mesh", file=sys.stderr,
                               disable=not progress, leave=False):
    out.enumerated += len(group)
    found, over = evaluate_group(ev, group, out.refused)
    out.results += found
    out.over_memory += over
  out.results.sort(key=rank)
  why_not = can_compile(target.device) if compile_top else "compile not asked (--compile-top 0)"
  if why_not:
    out.compile_notes.append(f"not compiled: {why_not}; ranked by the analytic estimate")
  else:
    compile_best(ev, out, compile_top, t0 + budget_s, progress)
  out.results.sort(key=rank)
  if out.results:
    out.flops_per_step = out.results[0].estimate["flops_per_step"]
  out.seconds = time.perf_counter() - t0
  return out


def seconds(t: float) -> str:
  return f"{t:.3f} s" if t >= 1 else f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


def render(out: Outcome, top: int) -> str:
  """The header, the table of the `top` best layouts, the commonest refusals."""
  t, row = out.target, out.row or devices.TABLE[devices.of(out.target.device).key]
  n_ok = len(out.results)
  where = (f"simulated on this host, each measured at {row.peak_bf16_flops / 1e9:.1f} GFLOP/s bf16, "
           f"{row.bandwidth / 1e9:.1f} GB/s" if t.cpu else f"{t.hosts} host(s) of {min(t.per_host, t.gpus)}")
  L = [f"plan: {out.config} on {t.gpus} x {t.device} ({where}): {out.enumerated} layouts, "
       f"{sum(out.refused.values())} refused, {out.over_memory} over memory, {n_ok} can run; {out.seconds:.0f} s",
       *out.compile_notes, ""]
  head = ("#", "layout", "memory/device", "exposed comm", "step", "MFU", "tokens/s/GPU", "from")
  rows = [head]
  for i, r in enumerate(out.results[:top], 1):
    tokens = out.tokens_per_step / r.step_s / t.gpus
    mfu = out.flops_per_step / (r.step_s * t.gpus * row.peak_bf16_flops)
    src = "bill, analytic bound"
    if r.compiled:
      src = "compiled, FLOPs bound" if r.compiled["floored"] else "compiled" + (
          ", calibrated" if r.compiled["calibrated"] else "")
    rows.append((str(i), r.layout.label(), memory.human(r.memory), seconds(r.exposed_s), seconds(r.step_s), f"{mfu:.1%}", f"{tokens:,.0f}", src))
  widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
  L += ["  ".join(c.rjust(w) if i in (0, 2, 3, 4, 5, 6) else c.ljust(w) for i, (c, w) in enumerate(zip(x, widths)))
        for x in rows]
  if n_ok > top:
    L.append(f"... {n_ok - top} more (--top N shows more)")
  if out.refused:
    L += ["", "refused most often (the config's own one-line refusals):"]
    L += [f"  {n:>5} x {why}" for why, n in sorted(out.refused.items(), key=lambda kv: -kv[1])[:3]]
  return "\n".join(L)

