"""inspect's report: every parameter's sharding, the memory bill and its fit verdict, FLOPs,
communication, and with `compile` XLA's view of the compiled step; as a dict (`--json`) and text."""

from __future__ import annotations

import collections
import math
import re
import sys

from jaxtrain.analysis import comms, fit, gpu_compile, memory
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import devices
from jaxtrain.parallel import mesh as mesh_lib

human = memory.human


def target_mesh(device: str, spec: str, compile: bool, device_memory: str | None):
  """(mesh, --device-memory value, else the kind's) for --device KIND: compile-only devices
  where it has a TargetConfig and the CUDA plugin is installed (the host backend pinned to
  CPU), else simulated CPU devices (--compile says so on stderr, or is an error without one)."""
  key = devices.of(device).key
  if key is None:
    raise UserError(f"--device {device!r} is not a known device; known: {', '.join(devices.TABLE)}")
  name = gpu_compile.target(device)
  if compile and name is None:
    raise UserError(f"--compile --device {device}: XLA:GPU compile targets exist for "
                    f"{', '.join(gpu_compile.TARGETS.values())} only; drop --compile for the analytic bill of this device")
  device_memory = device_memory or key
  if name is not None and gpu_compile.plugin_installed():
    import jax
    jax.config.update("jax_platforms", "cpu")
    return gpu_compile.mesh(device, spec), device_memory
  if compile:
    print(f"jaxtrain.inspect: no CUDA plugin installed (pip install 'jaxtrain[gpu-aot]'), so --compile uses XLA:CPU "
          f"on simulated CPU devices, not XLA:GPU for {name}", file=sys.stderr)
  sizes, _ = mesh_lib.parse_full(spec)  # dcn factors only order devices: the bill does not depend on them
  if -1 not in sizes.values():
    mesh_lib.provide_cpu_devices(math.prod(sizes.values()))
  return mesh_lib.build(sizes), device_memory


def compiled_memory(setup) -> dict:
  """Compiles the real train step: XLA's per-device memory analysis and what the program shows."""
  print("compiling the train step (this can take a minute for large models)...", file=sys.stderr, flush=True)
  compiled, seconds = gpu_compile.compile_step(setup)
  print(f"compiled in {seconds:.1f}s", file=sys.stderr, flush=True)
  shows = gpu_compile.analyse(compiled, setup.mesh, setup.cfg.train.seq_len, setup.plan)
  from jaxtrain.analysis import overlap
  from jaxtrain.parallel import pipeline
  dev = setup.mesh.devices.flat[0]
  shows["overlap"] = overlap.report(gpu_compile.Hlo.parse(compiled.as_text()),
                                    devices.of(dev).entry if dev.platform == "gpu" else None,
                                    **pipeline.tick_table(setup.cfg, setup.mesh))
  tick_roofline(shows)
  m = gpu_compile.CompiledMemory.of(compiled)
  return {"seconds": seconds, "available": m is not None, **(m.fields() if m else {}), **shows,
          "host_arguments": host_argument_bytes(compiled.as_text())}


def tick_roofline(shows: dict) -> None:
  """A pipelined step's roofline from its ticks as the schedule runs them (the predictor's kernels at their roofline,
  each tick its slowest device's). XLA's cost analysis counts a conditional as its longest branch, so the tick
  switch as a backward on every tick, idle ones too: no lower bound for a pipeline (kept beside it)."""
  roof, totals = shows.get("roofline"), (shows.get("overlap") or {}).get("totals") or {}
  if not roof or not totals.get("pipeline_ticks_counted"):
    return
  shows["roofline"] = {**roof, "xla_cost_analysis_seconds": roof["seconds"], "seconds": totals["compute_seconds"],
                       "bound": "per-kernel",
                       "label": "lower bound, not a measurement: each kernel at max(FLOPs / peak, bytes / HBM "
                                "bandwidth), one after another, a pipeline's ticks as its schedule runs them (each "
                                "its slowest device's); excludes communication"}


def host_argument_bytes(hlo_text: str) -> int:
  """Bytes of the step's arguments that the compiled program keeps in host memory (layout memory space
  S(5)); XLA's memory analysis counts them with the device's arguments."""
  head = hlo_text.split("\n", 1)[0]  # HloModule ..., entry_computation_layout={(arguments)->outputs}
  entry = head.partition("entry_computation_layout={(")[2].partition(")->")[0]
  return sum(gpu_compile.shape_bytes(f"{t}[{dims}]")
             for t, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]\{[^}]*S\(5\)\}", entry))


def replication_warnings(rows, mesh, threshold: int) -> list[str]:
  """A parameter of >= threshold bytes per device left fully replicated on a multi-device mesh."""
  from jaxtrain.parallel import sharding
  out = []
  for r in rows:
    if mesh.size == 1 or r.bytes < threshold or any(r.spec):
      continue
    would = sorted({a for name in r.axes if name for a in sharding.RULES.get(name, ())}, key=mesh_lib.AXES.index)
    hint = (f"a mesh with {' or '.join(would)} > 1 would shard it" if would else
            f"no rule in sharding.RULES splits its logical axes {r.axes}")
    out.append(f"{r.path}{f' (x{r.count})' if r.count > 1 else ''}: {r.bytes / 2**20:.1f} MiB per device, fully replicated on all {mesh.size} "
               f"devices; {hint}")
  return out


def data_segments(cfg) -> int | None:
  """The most segments a row of the config's data holds over train.steps (the attention path), or None where the
  data cannot be read here (inspect plans a run for elsewhere too)."""
  from jaxtrain import data
  try:
    return data.most_segments(cfg, cfg.train.steps)
  except UserError:
    return None


def report(cfg, mesh, config_name: str, *, compile: bool = False, device_memory: str | None = None,
           margin: float = 0.10, warn_replicated: int = 16 * 2**20, device: str | None = None) -> dict:
  """`device`: a device-table name; the bill is then for that device's kernels (its plan),
  whatever devices the mesh here holds."""
  from jaxtrain.model import flops
  from jaxtrain.parallel import plan as plan_lib
  from jaxtrain.run import step as step_lib
  segments = data_segments(cfg)
  setup = step_lib.Setup(cfg, mesh, segments=segments)
  cfg = setup.cfg  # with what the mesh implies
  rows = memory.grouped(memory.param_rows(setup))  # the compute layout: the bill's per-layer figures
  table = memory.grouped(memory.param_rows(setup, stored=True))  # the master as stored, as the bill counts it
  target = plan_lib.build(cfg, mesh, device=device, segments=segments) if device else setup.plan
  b = memory.bill(setup, rows, margin, plan=target)
  dev = mesh.devices.flat[0]
  capacity, source = memory.device_memory(device_memory, dev.device_kind)
  fits, verdict = fit.verdict(b.total, capacity, b.items)
  t = cfg.train
  per_token = flops.flops_per_token(cfg.model, t.seq_len)
  per_step = per_token * t.batch_size * t.seq_len
  rep = {
      "config": config_name, "mesh": mesh_lib.describe(dict(mesh.shape)), "devices": mesh.size,
      "device_kind": dev.device_kind, "batch_size": t.batch_size, "seq_len": t.seq_len,
      "microbatches": t.microbatches, "compute_dtype": cfg.model.dtype, "fp8": cfg.model.fp8,
      "params": [dict(path=r.path, count=r.count, axes=list(r.axes),
                      spec=[list(e) if isinstance(e, tuple) else e for e in r.spec],
                      shape=list(r.shape), device_shape=list(r.device_shape), dtype=r.dtype, bytes=r.bytes)
                 for r in table],
      "param_layout": target.state_layout(),
      "param_count": setup.n_params,
      "param_bytes_per_device": sum(r.bytes * r.count for r in table),
      "memory": {"items": b.items, "notes": b.notes, "total": b.total, "remat": cfg.model.remat,
                 "attention": target.attention + (" inside ulysses" if target.ulysses else ""),
                 "attention_why": target.attention_why, "loss": target.loss_why,
                 "for_device": device or dev.device_kind,
                 "activations_full_remat": b.full_remat_activations,
                 "device_memory": capacity, "device_memory_source": source, "fits": fits, "verdict": verdict,
                 "state_layout": target.state_layout(), "host_per_host": b.host_per_host},
      "flops": {"per_token": per_token, "per_step": per_step, "per_device_per_step": per_step / mesh.size},
      "comms": comms.traffic(cfg, mesh, rows),
      "notes": list(setup.notes),
      "warnings": replication_warnings(table, mesh, warn_replicated),
  }
  if mesh.shape["sequence"] > 1:  # both forms of attention over `sequence`, to choose model.sequence_attention
    rep["sequence_attention"] = {"runs": cfg.model.sequence_attention, **comms.sequence_forms(cfg, mesh)}
  if mesh.shape.get("pipeline", 1) > 1:
    from jaxtrain.analysis import timeline
    rep["pipeline"] = timeline.report(setup)
  if compile:
    rep["compiled"] = _compiled_section(setup, b, target, capacity, rep["memory"])
  return rep


def _compiled_section(setup, b, target, capacity, mem: dict) -> dict:
  """The compiled step's memory beside the bill's (`mem`'s verdict becomes the compiled total's)."""
  c = compiled_memory(setup)
  if not c["available"]:
    return c
  i = b.items
  state = i["master"] + i["adam_m"] + i["adam_v"] + i["counters"] + (0 if setup.layout.separate else i["params"])
  c["analytic"] = {"arguments": state + i["batch"], "outputs": state,
                   "temporaries": b.total - state - i["batch"], "total": b.total}
  offload, placed = target.cfg.optim.offload == "host", c["host_arguments"] > 0
  c["total"] -= c["host_arguments"]  # on the device
  c["ratio"] = c["total"] / b.total
  c["ratio_without_margin"] = c["total"] / (b.total - i["margin"])
  if offload and not placed:
    c["host_placement"] = (f"{c['compiler']} placed no argument in host memory (the target's devices report "
                           "no memory kinds), so its figures keep master and moments on the device; the "
                           "verdict is the bill's")
  elif capacity is not None:  # the compiled total, when there is one, decides the fit
    mem["fits"], mem["verdict"] = fit.verdict(c["total"], capacity, compiler=c["compiler"])
  return c


def _render_params(rep: dict) -> list[str]:
  """The parameter table: one row per parameter (repeated layers once, with their count)."""
  L = []
  spec = lambda s: "(" + ", ".join("+".join(e) if isinstance(e, list) else str(e) for e in s) + ")"  # noqa: E731
  cols = [(p["path"], str(p["count"]), "(" + ", ".join(map(str, p["axes"])) + ")", spec(p["spec"]),
           str(tuple(p["shape"])), str(tuple(p["device_shape"])), p["dtype"], f"{p['bytes']:,}")
          for p in rep["params"]]
  head = ("path", "count", "logical axes", "PartitionSpec", "global shape", "per device", "dtype", "bytes/device")
  widths = [max(len(r[i]) for r in [head, *cols]) for i in range(len(head))]
  for r in [head, *cols]:
    L.append("  " + "  ".join(c.rjust(w) if i in (1, 7) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
  L += [f"  total: {rep['param_count']:,} parameters; {rep['param_bytes_per_device']:,} bytes per device "
        f"({human(rep['param_bytes_per_device'])})", ""]
  return L


def _render_memory(rep: dict) -> list[str]:
  """The memory bill, then the compiled step's memory beside it (inspect --compile)."""
  L = []
  mem = rep["memory"]
  L.append(f"Memory per device (analytic, for {mem['for_device']}: attention {mem['attention']}, "
           f"remat {mem['remat']})")
  L.append(f"  attention: {mem['attention_why']}")
  L.append(f"  loss: {mem['loss']}")
  for k, v in [*mem["items"].items(), ("total", mem["total"])]:
    L.append(f"  {k:<17} {human(v):>11} {v:>17,}  {mem['notes'].get(k, '')}".rstrip())
  L.append(f"  (activations with full remat per block would be {human(mem['activations_full_remat'])}; "
           f"model.remat is {mem['remat']})")
  L.append(f"  ({mem['state_layout']}" + (f"; host memory per host {human(mem['host_per_host'])})"
                                          if mem["host_per_host"] else ")"))
  src = f" [{mem['device_memory_source']}]" if mem["device_memory"] else ""
  L.append(f"  verdict{src}: {mem['verdict']}")
  if "compiled" in rep:
    c = rep["compiled"]
    L += ["", f"Compiled train step by {c['compiler']} for {c['device_kind']} (XLA memory analysis per device; "
              f"compiled in {c['seconds']:.1f}s)"]
    if not c["available"]:
      L.append("  this backend gives no memory analysis")
    else:
      L.append(f"  {'':<15} {'compiled':>12} {'analytic':>12}")
      for k in ("arguments", "outputs", "aliased", "temporaries", "generated_code", "total"):
        a = c["analytic"].get(k)
        L.append(f"  {k:<15} {human(c[k]):>12} {'' if a is None else human(a):>12}")
      L.append(f"  ratio compiled/analytic total: {c['ratio']:.2f} ({c['ratio_without_margin']:.2f} without the margin)")
      if c["host_arguments"] or "host_placement" in c:
        where = c.get("host_placement") or f"{human(c['host_arguments'])} of arguments (not in the totals)"
        L.append(f"  host memory: {where}")
    L.extend(render_compiled(c))
  return L


def render(rep: dict) -> str:
  from jaxtrain.model import flops
  fp8 = rep.get("fp8", "none")
  L = [f"jaxtrain.inspect: {rep['config']} ({rep['param_count']:,} params) on mesh {rep['mesh']} "
       f"({rep['devices']} x {rep['device_kind']}); batch {rep['batch_size']} x {rep['seq_len']} tokens, "
       f"{rep['microbatches']} microbatch(es), compute {rep['compute_dtype']}{flops.fp8_label(fp8)}", "",
       "Parameters (per device, as stored: float32 master, or the dtype shown where there is none; "
       f"{rep.get('param_layout', 'train state: zero-0').removeprefix('train state: ')}; "
       "layers/* = repeated layers, shown once with their count)"]
  L += _render_params(rep)
  L += _render_memory(rep)
  if "pipeline" in rep:
    from jaxtrain.analysis import timeline
    L += ["", *timeline.render(rep["pipeline"])]
  f = rep["flops"]
  L += ["", f"Model FLOPs (as for MFU): {f['per_token']:.4g} per token, {f['per_step']:.4g} per step, "
            f"{f['per_device_per_step']:.4g} per device per step", *([flops.FP8_MFU_NOTE] if fp8 != "none" else []),
        "", "Communication per device per step (analytic)"]
  L += [f"  {axis:<9} {human(sum(parts.values())):>12}  " + "; ".join(f"{k} {human(v)}" for k, v in parts.items())
        for axis, parts in rep["comms"].items()] or ["  none (single device)"]
  if "sequence_attention" in rep:
    f = rep["sequence_attention"]
    form = lambda v: human(v) if isinstance(v, int) else f"cannot run ({v})"  # noqa: E731
    L.append(f"  attention over sequence, per layer and microbatch (fwd+bwd): ring K/V {form(f['ring'])}; "
             f"ulysses all-to-all {form(f['ulysses'])} (model.sequence_attention={f['runs']})")
  if rep["notes"] or rep["warnings"]:
    L.append("")
  notes = collections.Counter(memory.generic_path(n) for n in rep["notes"])  # repeated layers' notes, once
  L += [f"note: {n}" + (f" (x{count})" if count > 1 else "") for n, count in notes.items()]
  L += [f"warning: {w}" for w in rep["warnings"]]
  return "\n".join(L)


def render_compiled(c: dict) -> list[str]:
  """Lines for what the compiled program shows: kernel, cuDNN calls, collectives, cost, roofline."""
  L = []
  att = c.get("cudnn_attention", {})
  if "attention" in c:
    L.append(f"  attention: {c['attention']['kernel']} ({c['attention']['reason']})")
  kinds = f" (mask types {', '.join(att['mask_types'])}; {att['with_bias']} with a bias operand)" if att.get("ops") else ""
  L.append(f"  cuDNN fused attention: {att.get('ops', 0)} custom call(s) in the program, {att.get('per_step', 0)} "
           f"executed per step{kinds}")
  if "gemms" in c:
    g = c["gemms"]
    L.append(f"  GEMMs: {g['fp8']['ops']} FP8 (cuBLASLt FP8 or f8 operands), {g['other']['ops']} other in the program; "
             f"{g['fp8']['per_step']} FP8, {g['other']['per_step']} other executed per step")
  if c.get("square_buffers"):
    L.append(f"  L x L buffers: {', '.join(c['square_buffers'][:4])}")
  L.append("  collectives (per device; bytes = larger side of each op, times executions per step):")
  ops = [(name, r) for name, r in c.get("collectives", {}).items() if r["ops"]]
  L += [f"    {name:<19} {r['ops']:>4} op(s), {r['per_step']:>5} per step, {human(r['bytes_per_step']):>11} per step, "
        f"largest {human(r['largest_bytes'])}; {r['async']} async, {r['sync']} sync" for name, r in ops] or ["    none"]
  cost = c.get("cost") or {}
  if "flops" in cost:
    L.append(f"  XLA cost analysis (loop bodies x trip count): {cost['flops']:.4g} FLOPs, "
             f"{human(cost['bytes_accessed'])} accessed per device per step")
  elif "error" in cost:
    L.append(f"  XLA cost analysis unavailable: {cost['error']}")
  L.extend(overlap_lines(c.get("overlap")))
  roof = c.get("roofline")
  if roof:
    secs = lambda t: f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us"  # noqa: E731
    how = (f"XLA's cost analysis, the tick switch's longest branch on every tick: {secs(roof['xla_cost_analysis_seconds'])}"
           if roof["bound"] == "per-kernel" else
           f"{roof['bound']}-bound; compute {secs(roof['compute_seconds'])}, memory {secs(roof['memory_seconds'])}")
    L.append(f"  roofline: step time >= {secs(roof['seconds'])} ({how}); a {roof['label']}")
  return L


def overlap_lines(ov: dict | None) -> list[str]:
  """Per collective kind: async ops, exposed time; the loops' all-gathers; the predicted step (analysis.overlap)."""
  if not ov:
    return []
  ms = lambda t: f"{t * 1e3:.3g} ms"  # noqa: E731
  L = ["  overlap (estimate: bytes over the link bandwidth, minus the roofline of the kernels scheduled under each):"]
  for k, v in ov["per_kind"].items():
    t = f"; {ms(v['seconds'])} on the link, {ms(v['exposed_seconds'])} exposed" if "seconds" in v else ""
    L.append(f"    {k:<19} {v['asynchronous']}/{v['ops']} async, {human(v['wire_bytes'])} on the wire per step{t}")
  for lp in ov["loops"]:
    hid = f", {lp['hidden_fraction']:.0%} of their time hidden" if "hidden_fraction" in lp else ""
    L.append(f"    loop x{lp['trip']}: {lp['all_gathers']} all-gather(s), {lp['with_compute_under']} with compute "
             f"under them{hid}; {lp['next_iteration_prefetched']} prefetched for the next iteration")
  tot = ov.get("totals")
  if tot:
    L.append(f"    predicted step: {ms(tot['predicted_step_seconds'])} = compute {ms(tot['compute_seconds'])} + exposed "
             f"communication {ms(tot['exposed_seconds'])} (a {tot['label']})")
    if "calibrated_step_seconds" in tot:
      c = tot["calibration"]
      factor = c["measured_s"] / c["predicted_s"]
      L.append(f"    calibrated prediction: {ms(tot['calibrated_step_seconds'])} (x{factor:.3f}, the predictor's "
               f"measured/predicted on {c['what']}; still a prediction, not a measurement)")
  return L

