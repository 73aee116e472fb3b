"""`python -m jaxtrain.inspect`: how a run lays out and whether it fits, before launch.

    python -m jaxtrain.inspect --mesh fsdp=8,tp=8 --config llama3-8b [--set ...] [--compile]
        [--device-memory 80GiB|H100] [--margin 0.1] [--warn-replicated 16MiB] [--json]

Prints every parameter's sharding, the memory bill per device, model FLOPs and the bytes
each mesh axis moves per step; nothing of the model is allocated. `--compile` also lowers
and compiles the real train step from abstract inputs and prints XLA's memory analysis
beside the analytic bill. Simulated CPU devices stand in for the mesh, as in the trainer.
"""

from __future__ import annotations

import json
import sys

from jaxtrain import cli
from jaxtrain.core.errors import UserError

# The fields of one batch (see data.fields_from_rows), all int32 (batch, seq_len).


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.inspect", description="Show parameter shardings, the memory bill, FLOPs and "
                                                      "communication of a run before launching it.")
  cli.add_mesh_args(p)
  cli.add_config_args(p, help_config=False)
  p.add_argument("--compile", action="store_true", help="also compile the train step and print XLA's memory analysis")
  p.add_argument("--device", metavar="KIND",
                 help="target device kind, a name of the device table (H100, H200, A100-80GB, B200, ...): the bill, "
                      "its attention kernel and the verdict are for that device, whatever runs inspect; with "
                      "--compile (H100, H200, A100-80GB) XLA's GPU compiler compiles the step for a mesh of them "
                      "without any GPU here (needs the gpu-aot extra)")
  p.add_argument("--device-memory", metavar="SIZE|KIND",
                 help="memory per device for the verdict: a size (80GiB, 80GB, bytes) or a device kind (H100, ...); "
                      "default: the local device's kind, if known")
  p.add_argument("--margin", type=float, default=0.10,
                 help="temporaries and communication buffers, as a fraction of the rest of the bill (default 0.10)")
  p.add_argument("--warn-replicated", default="16MiB", metavar="SIZE",
                 help="warn about a fully replicated parameter of at least this size per device (default 16MiB)")
  p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
  return p.parse_args(argv)


def compiled_memory(setup) -> dict:
  """Lowers and compiles the real train step (for the mesh's devices: XLA:GPU for
  compile-only GPUs); XLA's per-device memory analysis and what the program shows."""
  from jaxtrain.analysis import gpu_compile
  print("compiling the train step (this can take a minute for large models)...", file=sys.stderr, flush=True)
  compiled, seconds = gpu_compile.compile_step(setup)
  print(f"compiled in {seconds:.1f}s", file=sys.stderr, flush=True)
  shows = gpu_compile.analyse(compiled, setup.mesh, setup.cfg.train.seq_len, setup.plan)
  ma = compiled.memory_analysis()
  if ma is None:
    return {"seconds": seconds, "available": False, **shows}
  out = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
         "aliased": ma.alias_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
         "generated_code": ma.generated_code_size_in_bytes}
  out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["generated_code"]
  return {"seconds": seconds, "available": True, **out, **shows}


def replication_warnings(rows, mesh, threshold: int) -> list[str]:
  """A parameter of >= threshold bytes per device left fully replicated on a multi-device mesh."""
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.parallel import sharding
  out = []
  for r in rows:
    if mesh.size == 1 or r.bytes < threshold or any(r.spec):
      continue
    would = sorted({a for name in r.axes if name for a in sharding.RULES.get(name, ())}, key=mesh_lib.AXES.index)
    hint = (f"a mesh with {' or '.join(would)} > 1 would shard it" if would else
            f"no rule in sharding.RULES splits its logical axes {r.axes}")
    times = f" (x{r.count})" if r.count > 1 else ""
    out.append(f"{r.path}{times}: {r.bytes / 2**20:.1f} MiB per device, fully replicated on all {mesh.size} "
               f"devices; {hint}")
  return out


def report(cfg, mesh, config_name: str, *, compile: bool = False, device_memory: str | None = None,
           margin: float = 0.10, warn_replicated: int = 16 * 2**20, device: str | None = None) -> dict:
  """`device`: a device-table name; the bill is then for that device's kernels (its plan),
  whatever devices the mesh here holds."""
  from jaxtrain.analysis import comms
  from jaxtrain.parallel import devices
  from jaxtrain.model import flops
  from jaxtrain.analysis import memory
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.parallel import plan as plan_lib
  from jaxtrain.run import step as step_lib
  setup = step_lib.Setup(cfg, mesh)
  all_rows = memory.param_rows(setup)
  rows = memory.grouped(all_rows)
  target = plan_lib.build(cfg, mesh, device=devices.stand_in(device)) if device else setup.plan
  b = memory.bill(setup, rows, margin, plan=target)
  dev = mesh.devices.flat[0]
  capacity, source = memory.device_memory(device_memory, dev.device_kind)
  t = cfg.train
  per_token = flops.flops_per_token(cfg.model, t.seq_len)
  per_step = per_token * t.batch_size * t.seq_len
  rep = {
      "config": config_name, "mesh": mesh_lib.describe(dict(mesh.shape)), "devices": mesh.size,
      "device_kind": dev.device_kind, "batch_size": t.batch_size, "seq_len": t.seq_len,
      "microbatches": t.microbatches, "compute_dtype": cfg.model.dtype,
      "params": [dict(path=r.path, count=r.count, axes=list(r.axes), spec=[_spec(e) for e in r.spec],
                      shape=list(r.shape), device_shape=list(r.device_shape), dtype=r.dtype, bytes=r.bytes)
                 for r in rows],
      "param_count": setup.n_params,
      "param_bytes_per_device": sum(r.bytes * r.count for r in rows),
      "memory": {"items": b.items, "notes": b.notes, "total": b.total, "remat": cfg.model.remat,
                 "attention": target.attention, "for_device": device or dev.device_kind,
                 "activations_full_remat": b.full_remat_activations,
                 "device_memory": capacity, "device_memory_source": source,
                 "fits": None if capacity is None else b.total <= capacity, "verdict": memory.verdict(b, capacity)},
      "flops": {"per_token": per_token, "per_step": per_step, "per_device_per_step": per_step / mesh.size},
      "comms": comms.traffic(cfg, mesh, rows),
      "notes": list(setup.notes),
      "warnings": replication_warnings(rows, mesh, warn_replicated),
  }
  if mesh.shape.get("pipeline", 1) > 1:
    from jaxtrain.parallel import pipeline
    rep["pipeline"] = pipeline.report(cfg, mesh)
  if compile:
    c = compiled_memory(setup)
    if c["available"]:
      i = b.items
      c["analytic"] = {
          "arguments": i["params"] + i["adam_m"] + i["adam_v"] + i["counters"] + i["batch"],
          "outputs": i["params"] + i["adam_m"] + i["adam_v"] + i["counters"],
          "temporaries": b.total - (i["params"] + i["adam_m"] + i["adam_v"] + i["counters"] + i["batch"]),
          "total": b.total,
      }
      c["ratio"] = c["total"] / b.total
      c["ratio_without_margin"] = c["total"] / (b.total - i["margin"])
      if capacity is not None:  # the compiled total, when there is one, decides the fit
        from jaxtrain.analysis import gpu_compile
        rep["memory"]["fits"] = c["total"] <= capacity
        rep["memory"]["verdict"] = gpu_compile.verdict(c["total"], capacity, c["compiler"])
    rep["compiled"] = c
  return rep


def _collapse(lines: list[str]) -> dict[str, int]:
  """Identical notes about repeated layers, once with a count."""
  from jaxtrain.analysis import memory
  out: dict[str, int] = {}
  for line in lines:
    key = memory.generic_path(line)
    out[key] = out.get(key, 0) + 1
  return out


def _spec(entry):
  return list(entry) if isinstance(entry, tuple) else entry


def _fmt_spec(spec) -> str:
  return "(" + ", ".join("+".join(e) if isinstance(e, list) else str(e) for e in spec) + ")"


def render(rep: dict) -> str:
  from jaxtrain.analysis import memory
  L = []
  L.append(f"jaxtrain.inspect: {rep['config']} ({rep['param_count']:,} params) on mesh {rep['mesh']} "
           f"({rep['devices']} x {rep['device_kind']}); batch {rep['batch_size']} x {rep['seq_len']} tokens, "
           f"{rep['microbatches']} microbatch(es), compute {rep['compute_dtype']}")
  L.append("")
  L.append("Parameters (per device; layers/* = repeated layers, shown once with their count)")
  cols = [(p["path"], str(p["count"]), "(" + ", ".join(map(str, p["axes"])) + ")", _fmt_spec(p["spec"]),
           str(tuple(p["shape"])), str(tuple(p["device_shape"])), p["dtype"], f"{p['bytes']:,}")
          for p in rep["params"]]
  head = ("path", "count", "logical axes", "PartitionSpec", "global shape", "per device", "dtype", "bytes/device")
  widths = [max(len(r[i]) for r in [head, *cols]) for i in range(len(head))]
  for r in [head, *cols]:
    L.append("  " + "  ".join(c.rjust(w) if i in (1, 7) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
  L.append(f"  total: {rep['param_count']:,} parameters; {rep['param_bytes_per_device']:,} bytes per device "
           f"({memory.human(rep['param_bytes_per_device'])})")
  L.append("")
  mem = rep["memory"]
  L.append(f"Memory per device (analytic, for {mem['for_device']}: attention {mem['attention']}, "
           f"remat {mem['remat']})")
  for k, v in mem["items"].items():
    L.append(f"  {k:<17} {memory.human(v):>11} {v:>17,}  {mem['notes'][k]}")
  L.append(f"  {'total':<17} {memory.human(mem['total']):>11} {mem['total']:>17,}")
  L.append(f"  (activations with full remat per block would be {memory.human(mem['activations_full_remat'])}; "
           f"model.remat is {mem['remat']})")
  src = f" [{mem['device_memory_source']}]" if mem["device_memory"] else ""
  L.append(f"  verdict{src}: {mem['verdict']}")
  if "compiled" in rep:
    c = rep["compiled"]
    L.append("")
    L.append(f"Compiled train step by {c['compiler']} for {c['device_kind']} (XLA memory analysis per device; "
             f"compiled in {c['seconds']:.1f}s)")
    if not c["available"]:
      L.append("  this backend gives no memory analysis")
    else:
      L.append(f"  {'':<15} {'compiled':>12} {'analytic':>12}")
      for k in ("arguments", "outputs", "aliased", "temporaries", "generated_code", "total"):
        a = c["analytic"].get(k)
        L.append(f"  {k:<15} {memory.human(c[k]):>12} {'' if a is None else memory.human(a):>12}")
      L.append(f"  ratio compiled/analytic total: {c['ratio']:.2f} ({c['ratio_without_margin']:.2f} without the margin)")
    from jaxtrain.analysis import gpu_report
    L.extend(gpu_report.render(c))
  if "pipeline" in rep:
    from jaxtrain.parallel import pipeline
    L += ["", *pipeline.render(rep["pipeline"])]
  f = rep["flops"]
  L.append("")
  L.append(f"Model FLOPs (as for MFU): {f['per_token']:.4g} per token, {f['per_step']:.4g} per step, "
           f"{f['per_device_per_step']:.4g} per device per step")
  L.append("")
  L.append("Communication per device per step (analytic)")
  if not rep["comms"]:
    L.append("  none (single device)")
  for axis, parts in rep["comms"].items():
    L.append(f"  {axis:<9} {memory.human(sum(parts.values())):>12}  " + "; ".join(f"{k} {memory.human(v)}" for k, v in parts.items()))
  if rep["notes"] or rep["warnings"]:
    L.append("")
  for n, count in _collapse(rep["notes"]).items():
    L.append(f"note: {n}" + (f" (x{count})" if count > 1 else ""))
  for w in rep["warnings"]:
    L.append(f"warning: {w}")
  return "\n".join(L)


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    from pathlib import Path
    from jaxtrain.analysis import memory
    if not 0 <= args.margin < 10:
      raise UserError(f"--margin {args.margin}: must be a fraction >= 0 (e.g. 0.1)")
    threshold = memory.parse_size(args.warn_replicated, "--warn-replicated")
    started = cli.start(args, "jaxtrain.inspect", mesh=args.device is None)
    mesh, device_memory = started.mesh, args.device_memory
    if args.device is not None:
      from jaxtrain.analysis import gpu_report
      mesh, device_memory = gpu_report.target_mesh(args.device, args.mesh, args.compile, args.device_memory)
    rep = report(started.cfg, mesh, Path(args.config).stem, compile=args.compile, device_memory=device_memory,
                 margin=args.margin, warn_replicated=threshold, device=args.device)
    print(json.dumps(rep, indent=1) if args.json else render(rep))
  return cli.main("jaxtrain.inspect", body)


if __name__ == "__main__":
  sys.exit(main())
