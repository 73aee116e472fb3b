"""Compile the real train step with XLA's GPU compiler for GPUs that are not here, and read it.

With the CUDA PJRT plugin (the gpu-aot extra), `jax.experimental.topologies` gives compile-only
devices of an XLA GPU TargetConfig (jaxtrain/gpu_targets/*.txtpb); the step, lowered from
ShapeDtypeStructs with its shardings, is compiled by XLA:GPU as on the pod; nothing runs. Read
back: memory analysis, collectives, cuDNN attention calls, cost analysis, a roofline bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import importlib.util
import math
import re
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp

from jaxtrain.core.errors import UserError
from jaxtrain.parallel import devices

# Device-table rows with a TargetConfig (file: the name in lower case + .txtpb).
TARGETS = {"H100": "H100", "H200": "H200", "A100": "A100-80GB"}
GPUS_PER_HOST = 8  # an HGX/DGX node: a mesh without dcn factors spans size/8 hosts
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def target(name) -> str | None:
  """The TargetConfig name for a device (anything `devices.of` takes), None where there is none."""
  return TARGETS.get(devices.of(name).key)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """XLA's per-device memory analysis of a compiled program, under inspect's names."""
  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  generated_code: int

  @property
  def total(self) -> int:
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code

  @classmethod
  def of(cls, compiled) -> "CompiledMemory | None":
    """None where the backend gives no memory analysis."""
    ma = compiled.memory_analysis()
    return None if ma is None else cls(*(int(getattr(ma, f"{f}_size_in_bytes")) for f in (
        "argument", "output", "alias", "temp", "generated_code")))

  def fields(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), "total": self.total}


def plugin_installed() -> bool:
  """The CUDA PJRT plugin (jax[cuda12] or jax[cuda13]) is importable; nothing is started."""
  return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def target_config(name) -> str:
  """The device's TargetConfig text with the installed plugin's cuDNN/CUDA versions (where
  they can be read), so XLA plans for the libraries this install would run with on the GPU."""
  text = importlib.resources.files("jaxtrain.gpu_targets").joinpath(target(name).lower() + ".txtpb").read_text()
  try:
    from jax._src.lib import cuda_versions
    dnn, rt = cuda_versions.cudnn_get_version(), cuda_versions.cuda_runtime_get_version()
  except Exception:  # noqa: BLE001 - any failure just keeps the file's versions
    return text
  text = re.sub(r"dnn_version_info \{[^}]*\}",
                f"dnn_version_info {{ major: {dnn // 10000} minor: {dnn // 100 % 100} patch: {dnn % 100} }}", text)
  return re.sub(r"runtime_version \{[^}]*\}",
                f"runtime_version {{ major: {rt // 1000} minor: {rt // 10 % 100} patch: 0 }}", text)


def mesh(name, spec: str):
  """The run's mesh (`--mesh` syntax, dcn factors included) over compile-only devices of the
  device `name`. Hosts: the product of the dcn factors, else one per 8 GPUs; -1 fills one host."""
  from jax.experimental import topologies
  from jaxtrain.parallel import mesh as mesh_lib
  sizes, dcn = mesh_lib.parse_full(spec)
  known = math.prod(s for s in sizes.values() if s != -1)
  count = known * (max(1, GPUS_PER_HOST // known) if -1 in sizes.values() else 1)
  hosts = max(math.prod(dcn.values()) if any(v > 1 for v in dcn.values()) else (
      count // GPUS_PER_HOST if count % GPUS_PER_HOST == 0 else 1), 1)
  if count % hosts:
    raise UserError(f"{count} devices cannot be spread evenly over {hosts} hosts")
  topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(name),
                                      topology=f"1x{hosts}x{count // hosts}")
  return mesh_lib.build(sizes, list(topo.devices), dcn)


def _capability_of(device):
  """jax's cuDNN attention wrapper checks the HOST backend's compute capability while
  tracing (packed segments need Hopper); for a compile-only target it answers for the target, only while
  the step is traced. A private module: where its checks are missing, tracing goes on unredirected (note)."""
  have = devices.of(device).capability
  if have == (0, 0):
    return contextlib.nullcontext()
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    assert callable(fa.check_compute_capability) and callable(fa.is_cuda_compute_capability_equal)
  except Exception:  # noqa: BLE001 (any change there means: cannot redirect)
    print("note: cannot point jax's cuDNN capability check at the target GPU (not in this jax); cuDNN attention "
          "may be refused while tracing here: use --set model.attention=xla if it is", file=sys.stderr)
    return contextlib.nullcontext()
  version = lambda c: tuple(map(int, c.split(".")))  # noqa: E731
  return mock.patch.multiple(fa, check_compute_capability=lambda c: have >= version(c),
                             is_cuda_compute_capability_equal=lambda c: have == version(c))


def compiler_options(cfg) -> dict[str, str]:
  """The config's XLA flags (run.xla_flags preset + extra) as compile options, as the trainer's XLA_FLAGS."""
  from jaxtrain.parallel import xla_flags
  flags = xla_flags.PRESETS[cfg.run.xla_flags] + xla_flags.parse(xla_flags.extra(cfg))
  # typed values: XLA refuses the string 'true' for a bool option ("is not a valid bool value")
  typed = lambda v: {"true": True, "false": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)  # noqa: E731
  return {f.split("=", 1)[0].removeprefix("--"): typed((f.split("=", 1) + ["true"])[1]) for f in flags}


def abstract_inputs(setup):
  """(state, batch) as ShapeDtypeStructs carrying the step's shardings: nothing allocated."""
  state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                       jax.eval_shape(setup.init), setup.state_shardings)
  t = setup.cfg.train
  batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=setup.batch_sharding)
           for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
  return state, batch


def compile_step(setup):
  """(compiled train step, seconds) from abstract inputs: nothing is allocated."""
  dev = setup.mesh.devices.flat[0]
  t0 = time.perf_counter()
  with _capability_of(dev):
    lowered = setup.step.lower(*abstract_inputs(setup))
  compiled = lowered.compile(compiler_options=compiler_options(setup.cfg) if dev.platform == "gpu" else None)
  return compiled, time.perf_counter() - t0


# ---- reading the optimized HLO -------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMP = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_INSTR = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
# (attribute, computation); a conditional on a predicate names its two branches, one on an index lists them all
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def branches(i) -> list[str]:
  """The computations a call or conditional runs: a call's callee, or every branch of a conditional (an index's
  branch_computations={...}, a predicate's true_computation and false_computation)."""
  named = [c for a, c in _CALLS.findall(i.rest) if a not in ("body", "condition")]
  return named + [b.strip().lstrip("%") for group in _BRANCHES.findall(i.rest) for b in group.split(",") if b.strip()]
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def shape_bytes(text: str) -> int:
  return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
             for dt, dims in _ARRAY.findall(text))


@dataclasses.dataclass
class Instr:
  name: str
  shape: str      # the result type text
  opcode: str
  rest: str       # operands and attributes
  computation: str


@dataclasses.dataclass
class Hlo:
  """The optimized HLO module, split into computations, with each computation's number
  of executions per step (product of the known trip counts of the loops around it)."""
  text: str
  instrs: list[Instr]
  times: dict[str, int]                 # computation -> executions per step
  loops: list[tuple[str, str, int]]     # (while body, enclosing computation, trip count)

  @classmethod
  def parse(cls, text: str) -> "Hlo":
    instrs, comp, entry = [], None, ""
    for line in text.splitlines():
      m = _COMP.match(line)
      if m:
        comp = m.group(1)
        entry = comp if line.startswith("ENTRY") else entry
        continue
      m = _INSTR.match(line)
      if m and comp:
        instrs.append(Instr(m.group(1), m.group(2), m.group(3), m.group(4), comp))
    edges: dict[str, list[tuple[str, int]]] = {}
    loops = []
    for i in instrs:
      trip = _TRIP.search(i.rest)
      for attr, callee in _CALLS.findall(i.rest):
        n = int(trip.group(1)) if attr == "body" and trip else 1  # only a while has a body
        edges.setdefault(i.computation, []).append((callee, n))
        if attr == "body":
          loops.append((callee, i.computation, n))
      for branch in _BRANCHES.findall(i.rest):
        edges.setdefault(i.computation, []).extend((b.strip().lstrip("%"), 1) for b in branch.split(","))
    times, todo = {entry: 1}, [entry]
    while todo:
      c = todo.pop()
      for callee, trip in edges.get(c, ()):
        n = times[c] * trip
        if n > times.get(callee, 0):
          times[callee] = n
          todo.append(callee)
    return cls(text, instrs, times, loops)


def collective_ops(hlo: Hlo):
  """(instruction, kind, bytes of one execution, executions per step) of each collective: `bytes` of one op is its
  larger side (the gathered result of an all-gather, the input of a reduce-scatter)."""
  shapes = {i.name: i.shape for i in hlo.instrs}
  called_root = {i.computation: i.opcode for i in hlo.instrs}  # a computation's last instruction is its ROOT
  for i in hlo.instrs:
    op = i.opcode.removesuffix("-start")
    is_start = i.opcode.endswith("-start")
    if i.opcode == "async-start":
      callee = _CALLS.search(i.rest)
      op = called_root.get(callee.group(2), "") if callee else ""
    if op not in COLLECTIVES:
      continue
    operands = re.findall(r"%([\w.\-]+)", i.rest.split("),", 1)[0])
    ins = sum(shape_bytes(shapes.get(o, "")) for o in operands)
    res = shape_bytes(i.shape)
    yield i, op, max(ins, res - ins) if is_start and res > ins else max(ins, res), hlo.times.get(i.computation, 1)


def collectives(hlo: Hlo) -> dict:
  """Per collective kind: ops in the program, executions and bytes per step, how many
  are asynchronous (a -start/-done pair XLA did not mark is_sync)."""
  out = {k: {"ops": 0, "per_step": 0, "bytes_per_step": 0, "async": 0, "sync": 0, "largest_bytes": 0}
         for k in COLLECTIVES}
  for i, op, size, n in collective_ops(hlo):
    r = out[op]
    r["ops"] += 1
    r["per_step"] += n
    r["bytes_per_step"] += n * size
    r["largest_bytes"] = max(r["largest_bytes"], size)
    r["async" if i.opcode.endswith("-start") and '"is_sync":true' not in i.rest else "sync"] += 1
  return out


def cudnn_attention_calls(hlo: Hlo) -> dict:
  """cuDNN fused-attention custom calls: in the program and executed per step, the mask types they were built with
  (CAUSAL, PADDING_CAUSAL: packed offsets) and how many read a bias operand (the L x L mask becomes one)."""
  calls = [i for i in hlo.instrs if i.opcode == "custom-call" and 'custom_call_target="__cudnn$fmha' in i.rest]
  types = {m.group(1) for i in calls for m in [re.search(r'"mask_type":\s*"(\w+)"', i.rest)] if m}
  biased = [i for i in calls if re.search(r'custom_call_target="__cudnn\$fmha\w*Bias', i.rest)]
  return {"ops": len(calls), "per_step": sum(hlo.times.get(i.computation, 1) for i in calls),
          "mask_types": sorted(types), "with_bias": len(biased)}


def gemms(hlo: Hlo) -> dict:
  """Matmul kernels by format, in the program and executed per step: `fp8` = cuBLASLt FP8 custom calls
  (`__cublas$lt$matmul$f8`) and GEMM fusions or dots that read an f8 operand; `other` = the rest (cuBLAS,
  Triton GEMM fusions, dots)."""
  shapes = {i.name: i.shape for i in hlo.instrs}
  dots = [i for i in hlo.instrs if i.opcode == "dot"]
  reads_f8 = lambda i: any(shapes.get(o, "").startswith("f8") for o in operands(i))  # noqa: E731
  fused: dict[str, bool] = {}  # computation holding a dot -> whether one of its dots reads f8
  for i in dots:
    fused[i.computation] = fused.get(i.computation, False) or reads_f8(i)
  callers = {c for i in hlo.instrs if i.opcode == "fusion" for c in re.findall(r"calls=%?([\w.\-]+)", i.rest)}
  out = {k: {"ops": 0, "per_step": 0} for k in ("fp8", "other")}
  for i in hlo.instrs:
    target = re.search(r'custom_call_target="(__cublas[^"]*)"', i.rest) if i.opcode == "custom-call" else None
    callee = re.search(r"calls=%?([\w.\-]+)", i.rest) if i.opcode == "fusion" else None
    if target:
      f8 = target.group(1).endswith("$f8")
    elif callee and callee.group(1) in fused:
      f8 = fused[callee.group(1)] or reads_f8(i)
    elif i.opcode == "dot" and i.computation not in callers:
      f8 = reads_f8(i)
    else:
      continue
    r = out["fp8" if f8 else "other"]
    r["ops"] += 1
    r["per_step"] += hlo.times.get(i.computation, 1)
  return out


def dims(shape: str) -> list[int]:
  m = re.search(r"\[([0-9,]*)\]", shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def operands(i) -> list[str]:
  return re.findall(r"%([\w.\-]+)", i.rest.split("),", 1)[0])


def dot_flops(i, shapes: dict[str, str]) -> float:
  """2 x result x contracted size of a dot or a cuBLAS GEMM custom call (its backend config's dimensions)."""
  ops = operands(i)
  lhs = dims(shapes.get(ops[0], "")) if ops else []
  m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", i.rest) or re.search(
      r'"lhs_contracting_dimensions":\[([^\]]*)\]', i.rest)
  axes = [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip('" ')] if m else []
  return 2.0 * math.prod(dims(i.shape)) * math.prod(lhs[a] for a in axes if a < len(lhs))


def _cublas_flops(hlo: Hlo) -> tuple[float, float]:
  """(FP8, other) FLOPs per step of the cuBLAS GEMM custom calls, which XLA's cost analysis does not count."""
  shapes, out = {i.name: i.shape for i in hlo.instrs}, [0.0, 0.0]
  for i in hlo.instrs:
    if i.opcode == "custom-call" and 'custom_call_target="__cublas' in i.rest:
      out['$f8"' not in i.rest] += dot_flops(i, shapes) * hlo.times.get(i.computation, 1)
  return out[0], out[1]


def square_buffers(hlo: Hlo, length: int) -> list[str]:
  """Array types in the program with two dimensions equal to `length`: an L x L buffer."""
  return sorted({f"{dt}[{dims}]" for dt, dims in _ARRAY.findall(hlo.text)
                 if [int(d) for d in dims.split(",") if d].count(length) >= 2})


def cost(hlo: Hlo) -> dict | None:
  """XLA's HloCostAnalysis of the optimized module, which counts a while body once: each
  body is also analysed alone and added (trip - 1) x (executions of its enclosing
  computation) times. Work inside custom calls (cuDNN attention) is invisible to it."""
  try:
    import jaxlib._hlo as hlo_lib
    from jax._src.lib import xla_client
    client = jax.devices("cpu")[0].client
    analyse = xla_client._xla.hlo_module_cost_analysis
    whole = analyse(client, hlo_lib.hlo_module_from_text(hlo.text))
    if whole is None:
      return None
    flops, nbytes = whole.get("flops", 0.0), whole.get("bytes accessed", 0.0)
    lines = hlo.text.split("\n")
    for body, outer, trip in hlo.loops:
      if trip <= 1:
        continue
      text = "\n".join(["HloModule body"] + [
          ("ENTRY " + ln) if _COMP.match(ln) and _COMP.match(ln).group(1) == body else ln.removeprefix("ENTRY ")
          for ln in lines[1:]])
      part = analyse(client, hlo_lib.hlo_module_from_text(text))
      extra = hlo.times.get(outer, 1) * (trip - 1)
      flops += extra * part.get("flops", 0.0)
      nbytes += extra * part.get("bytes accessed", 0.0)
    return {"flops": flops, "bytes_accessed": nbytes, "flops_once": whole.get("flops", 0.0),
            "bytes_accessed_once": whole.get("bytes accessed", 0.0)}
  except Exception as e:  # noqa: BLE001 - private API; the report says it is missing
    return {"error": f"{type(e).__name__}: {e}"[:200]}


def analyse(compiled, mesh, seq_len: int | None = None, plan=None) -> dict:
  """What the compiled program shows (inspect's `compiled` object); with the `plan`, also
  the attention kernel it chose, to set beside the cuDNN calls found."""
  dev = mesh.devices.flat[0]
  gpu = dev.platform == "gpu"
  hlo = Hlo.parse(compiled.as_text())
  out = {"backend": "cuda" if gpu else dev.platform, "device_kind": dev.device_kind,
         "compiler": "XLA:GPU, compile-only" if gpu else f"XLA:{dev.platform.upper()}",
         "collectives": collectives(hlo), "cudnn_attention": cudnn_attention_calls(hlo), "gemms": gemms(hlo)}
  if plan is not None:
    out["attention"] = {"kernel": plan.attention, "reason": plan.attention_why}
  if seq_len:
    out["square_buffers"] = square_buffers(hlo, seq_len)
  c = cost(hlo)
  if c is not None:
    out["cost"] = c
    row = devices.of(dev).entry if gpu else None
    if row and row.peak_bf16_flops and row.bandwidth and "flops" in c:
      fp8, other = _cublas_flops(hlo)
      peak_fp8 = row.peak_fp8_flops or row.peak_bf16_flops
      t_flops = (c["flops"] + other) / row.peak_bf16_flops + fp8 / peak_fp8
      t_bytes = c["bytes_accessed"] / row.bandwidth
      out["roofline"] = {
          "seconds": max(t_flops, t_bytes), "compute_seconds": t_flops, "memory_seconds": t_bytes,
          "bound": "compute" if t_flops >= t_bytes else "memory",
          "peak_flops": row.peak_bf16_flops, "peak_fp8_flops": peak_fp8, "fp8_gemm_flops": fp8,
          "bandwidth": row.bandwidth,
          "label": "lower bound, not a measurement: max(FLOPs / peak bf16 (FP8 GEMMs: / peak FP8), bytes / HBM "
                   "bandwidth) of XLA's cost analysis plus the cuBLAS GEMMs it cannot see; excludes communication "
                   "and the work inside cuDNN calls"}
  return out
