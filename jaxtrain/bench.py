"""`python -m jaxtrain.bench`: the real train step's speed, with baselines side by side.

    python -m jaxtrain.bench --config llama3-1b --mesh fsdp=1 [--steps 20] [--warmup 3]
        [--baseline minimal,torch|minimal|torch|none] [--rounds 3] [--measure-peak] [--out bench.json] [--set k=v ...]

Times `Setup.step` (compiled ahead of time, state donated, batches from jaxtrain.data
staged on the device before timing) over N steps after W warm-up steps. A step's time
runs from the end of the previous step to the end of this one, with the next step
already queued (as the trainer measures). With baselines, R rounds alternate N
jaxtrain steps and N steps of each baseline, and each ratio is taken round by round.
The GPU checks (attention kernels, matmul peak, remat policies, XLA flags, baselines at
the ~1B shape) are a pytest suite in a source checkout: `python -m pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from jaxtrain import cli
from jaxtrain.analysis.timing import first_batches, stats, time_steps
from jaxtrain.core import files
from jaxtrain.core.errors import UserError

BASELINES = ("minimal", "torch")
PEAK_SIZE = {"gpu": 8192, "tpu": 8192, "cpu": 1024}  # bf16 n x n x n matmul for --measure-peak


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.bench", description="Time the real train step; compare with baselines.")
  cli.add_config_args(p, help_config=False)
  cli.add_mesh_args(p)
  p.add_argument("--steps", type=int, default=10, help="timed steps per round and side (default 10)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the first round (default 2)")
  p.add_argument("--baseline", default="none", metavar="none|minimal|torch|minimal,torch",
                 help="minimal: a plain jax.jit step; torch: PyTorch, torch.compile + SDPA; both: minimal,torch "
                      "(default none)")
  p.add_argument("--rounds", type=int, default=3, help="alternating rounds with a baseline (default 3)")
  p.add_argument("--measure-peak", action="store_true", help="time a large bf16 matmul; MFU also against it")
  p.add_argument("--out", help="JSON result file (default <workdir>/bench.json)")
  p.add_argument("--workdir", help="where the default --out goes (default runs/<config>)")
  p.add_argument("--compare", action="append", default=[], metavar="NAME:SECTION.KEY=VALUE[,...]",
                 help="time variants of the config in one run, alternating rounds, with compiled memory per "
                      "device (repeatable; see jaxtrain/analysis/compare.py); no baselines")
  p.add_argument("--breakdown", type=int, default=0, metavar="N",
                 help="after timing, trace a few steps with jax.profiler and print the N ops that take the most time")
  return p.parse_args(argv)


def measure_peak(device, size: int | None = None, reps: int = 5) -> dict:
  """Best bf16 matmul throughput of one device over a few timed repeats, FLOP/s."""
  import jax
  import jax.numpy as jnp
  n = size or PEAK_SIZE.get(device.platform, 1024)
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.device_put(jax.random.normal(k1, (n, n), jnp.bfloat16), device)
  b = jax.device_put(jax.random.normal(k2, (n, n), jnp.bfloat16), device)
  mm = jax.jit(lambda x, y: x @ y)
  mm(a, b).block_until_ready()
  inner = 10 if device.platform != "cpu" else 2
  best = 0.0
  for _ in range(reps):
    t = time.perf_counter()
    outs = [mm(a, b) for _ in range(inner)]
    jax.block_until_ready(outs)
    best = max(best, inner * 2 * n**3 / (time.perf_counter() - t))
  return {"flops": best, "tflops": best / 1e12, "size": n, "dtype": "bfloat16"}


def device_peak_memory(devices) -> int | None:
  """Largest peak_bytes_in_use over the devices; None where the backend gives no stats (CPU)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  return max(peaks) if peaks and all(p is not None for p in peaks) else None


class _Side:
  """One trainer under test: dispatch/sync callables, compile time, timings."""

  def __init__(self, name, run, sync, compile_s, devices, box):
    self.name, self.run, self.sync, self.compile_s, self.devices = name, run, sync, compile_s, devices
    self.box = box  # box["i"]: steps dispatched so far; step i trains on batch i % len(batches)
    self.times: list[float] = []
    self.tokens: list[int] = []
    self.peak_memory, self.memory_note = None, ""
    self.pipelined = True


def jaxtrain_side(cfg, setup, batches):
  import jax
  state = setup.init()
  dev = [setup.device_batch(b) for b in batches]
  t = time.perf_counter()
  compiled = setup.step.lower(state, dev[0]).compile()
  compile_s = time.perf_counter() - t
  box = {"state": state, "i": 0, "compiled": compiled}

  def run():
    box["state"], metrics = compiled(box["state"], dev[box["i"] % len(dev)])
    box["i"] += 1
    return metrics["loss"]
  return _Side("jaxtrain", run, jax.block_until_ready, compile_s, list(setup.mesh.devices.flat), box)


def minimal_side(cfg, params, batches, device):
  import jax
  import jax.numpy as jnp
  from jaxtrain.analysis.baselines import minimal
  b = minimal.Minimal(cfg)
  state = b.init(params, device)
  dev = [{k: jax.device_put(jnp.asarray(v), device) for k, v in x.items()} for x in batches]
  t = time.perf_counter()
  compiled = b.step.lower(state, dev[0]).compile()
  compile_s = time.perf_counter() - t
  box = {"state": state, "i": 0}

  def run():
    box["state"], loss = compiled(box["state"], dev[box["i"] % len(dev)])
    box["i"] += 1
    return loss
  return _Side("minimal", run, jax.block_until_ready, compile_s, [device], box)


def torch_side(cfg, params, batches, platform):
  from jaxtrain.analysis.baselines import torch_model  # imports torch; only here
  try:
    b = torch_model.TorchBaseline(cfg, params, "cuda" if platform == "gpu" else "cpu")
  except ValueError as e:
    raise UserError(f"--baseline torch: {e}") from None
  dev = [b.to_device(x) for x in batches]
  box = {"i": 0}

  def run():
    loss = b.step(dev[box["i"] % len(dev)])
    box["i"] += 1
    return loss
  # torch.compile compiles on the first call: that call's time is the compile time.
  t = time.perf_counter()
  run().item()
  side = _Side("torch", run, lambda loss: loss.item(), time.perf_counter() - t, [], box)
  side.torch_baseline, side.pipelined = b, b.device.type == "cuda"  # CPU torch runs each step eagerly
  return side


def summarize(side: _Side, flops_per_step: float, n_devices: int, peak: float | None, measured: float | None) -> dict:
  per_dev = [flops_per_step / s / n_devices for s in side.times]
  return {
      "compile_s": side.compile_s,
      "step_time_s": stats(side.times),
      "tokens_per_s": stats([n / s for n, s in zip(side.tokens, side.times)]),
      "tflops_per_device": stats([f / 1e12 for f in per_dev]),
      "mfu": stats([f / peak for f in per_dev]) if peak else None,
      "mfu_vs_measured_peak": stats([f / measured for f in per_dev]) if measured else None,
      "peak_memory_bytes": side.peak_memory, "memory_note": side.memory_note, "devices": n_devices,
  }


def _progress(text: str) -> None:
  print(f"bench: {text}", flush=True)  # long work gets a line, not a silent minute


def run(cfg, mesh, config_name: str, *, steps: int, warmup: int, baselines: list[str], rounds: int,
        measure: bool, breakdown: int = 0, trace_dir: Path | None = None, batches: list[dict] | None = None) -> dict:
  """`batches`: numpy batches to cycle instead of jaxtrain.data's (e.g. synthetic tokens, tests/gpu)."""
  import jax
  import numpy as np
  from jaxtrain.analysis import baselines as baselines_lib
  from jaxtrain.analysis import costs
  from jaxtrain.analysis import fit
  from jaxtrain.model import flops
  from jaxtrain.analysis import memory
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import step as step_lib
  setup = step_lib.Setup(cfg, mesh)
  fit.check(setup, cfg.run.fit_check)
  dev0 = mesh.devices.flat[0]
  t = cfg.train
  unpacked = "torch" in baselines  # SDPA's flash path masks causally only: every side gets unpacked rows
  if batches is None:
    batches = first_batches(cfg, setup, min(steps, 4), unpacked)
  else:
    unpacked = unpacked or all((b["segment_ids"] == b["segment_ids"][:, :1]).all() for b in batches)
  valid = [int((b["loss_mask"] > 0).sum()) for b in batches]
  flops_per_step = flops.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
  peak = flops.peak_flops(dev0.device_kind)
  measured = measure_peak(dev0) if measure else None

  _progress(f"compiling the jaxtrain step ({config_name}, mesh {mesh_lib.describe(dict(mesh.shape))})")
  sides = [jaxtrain_side(cfg, setup, batches)]
  if baselines:
    # The baselines start from jaxtrain's initial weights (fetched before any step donates them).
    params0 = baselines_lib.layer_list(jax.device_get(setup.init()["params"]), cfg.model.n_layers)
    for name in baselines:
      _progress(f"compiling the {name} baseline")
      sides.append(minimal_side(cfg, params0, batches, dev0) if name == "minimal"
                   else torch_side(cfg, params0, batches, dev0.platform))
  for side in sides:
    for _ in range(warmup):
      side.sync(side.run())
  per_round: dict[str, list[float]] = {name: [] for name in baselines}
  for r in range(rounds if baselines else 1):
    _progress(f"timing round {r + 1}/{rounds if baselines else 1}: {steps} steps per side")
    medians = {}
    for side in sides:
      first = side.box["i"]
      times = time_steps(side.run, side.sync, steps, side.pipelined)
      side.tokens += [valid[(first + i) % len(valid)] for i in range(steps)]
      side.times += times
      medians[side.name] = float(np.median(times))
      if side.name == "jaxtrain" and r == 0:
        # Before any baseline step: the device peak is jaxtrain's own.
        side.peak_memory = device_peak_memory(side.devices)
        side.memory_note = ("device.memory_stats() peak_bytes_in_use, max over devices" if side.peak_memory is not None
                            else f"not reported by the {dev0.platform} backend")
    for name in baselines:  # same batches: step-time ratio = tokens/s ratio
      per_round[name].append(medians[name] / medians["jaxtrain"])
  for side in sides[1:]:
    if side.name == "torch":
      side.peak_memory = side.torch_baseline.peak_memory()
      side.memory_note = ("torch.cuda.max_memory_allocated()" if side.peak_memory is not None
                          else "not reported for torch on CPU")
    else:
      side.memory_note = "not separable: shares the device (and its peak counter) with jaxtrain"

  compiled = sides[0].box["compiled"]
  eff = costs.efficiency(compiled, flops_per_step / mesh.size, sum(memory.state_bytes(setup).values()))
  top = None
  if breakdown:
    def run_steps(n):
      for _ in range(n):
        sides[0].sync(sides[0].run())
    top = costs.breakdown(run_steps, min(steps, 3), compiled.as_text(), breakdown, trace_dir)
  mflops = measured and measured["flops"]
  return {
      "config": config_name, "mesh": mesh_lib.describe(dict(mesh.shape)), "devices": mesh.size,
      "platform": dev0.platform, "device_kind": dev0.device_kind, "batch_size": t.batch_size, "seq_len": t.seq_len,
      "compute_dtype": cfg.model.dtype, "batch": "one document per row" if unpacked else "packed",
      "steps": steps, "warmup": warmup, "rounds": rounds if baselines else 1, "baselines": baselines,
      "valid_tokens_per_step": stats(valid),
      "flops_per_token": flops_per_step / (t.batch_size * t.seq_len), "flops_per_step": flops_per_step,
      "flops_formula": "jaxtrain.model.flops.flops_per_token (as in jaxtrain.inspect)",
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "peak_flops_per_device": peak, "peak_source": "jaxtrain.parallel.devices.TABLE" if peak else
      f"unknown for device kind {dev0.device_kind!r}: MFU is null",
      "measured_peak": measured,
      "efficiency": eff,
      "breakdown": top,
      "jaxtrain": summarize(sides[0], flops_per_step, mesh.size, peak, mflops),
      "baseline_results": {s.name: summarize(s, flops_per_step, 1, peak, mflops) for s in sides[1:]},
      "ratios": {name: {**stats(q), "per_round": q,
                        "meaning": f"jaxtrain tokens/s / {name} tokens/s, from the median step time of each round"}
                 for name, q in per_round.items()},
  }


def _fmt(x, spec):
  return "n/a" if x is None else format(x, spec)


def table(rep: dict) -> str:
  rows = [("jaxtrain", rep["jaxtrain"]), *rep["baseline_results"].items()]
  L = [f"jaxtrain.bench: {rep['config']} on {rep['mesh']} ({rep['devices']} x {rep['device_kind']}), "
       f"batch {rep['batch_size']} x {rep['seq_len']} ({rep['batch']}), {rep['compute_dtype']}, "
       f"{rep['steps']} steps x {rep['rounds']} round(s)",
       f"{'':<9} {'step ms: median [min..max]':<28} {'tokens/s':>11} {'TFLOP/s/dev':>11} {'MFU':>6} "
       f"{'compile s':>9} {'peak mem':>10}"]
  for name, r in rows:
    st = r["step_time_s"]
    mfu = r["mfu"]["median"] if r["mfu"] else None
    mem = r["peak_memory_bytes"]
    steps = f"{st['median'] * 1e3:.2f} [{st['min'] * 1e3:.2f}..{st['max'] * 1e3:.2f}]"
    L.append(f"{name:<9} {steps:<28} {r['tokens_per_s']['median']:>11,.0f} {r['tflops_per_device']['median']:>11.4g} "
             f"{_fmt(mfu, '.1%'):>6} {r['compile_s']:>9.1f} {'n/a' if mem is None else f'{mem / 2**30:.2f} GiB':>10}")
  if rep["measured_peak"]:
    m = rep["measured_peak"]
    mfu = rep["jaxtrain"]["mfu_vs_measured_peak"]["median"]
    L.append(f"measured bf16 matmul peak ({m['size']}^3): {m['tflops']:.4g} TFLOP/s per device; "
             f"jaxtrain MFU against it {mfu:.1%}")
  e = rep["efficiency"]
  if e["compiled_over_model_flops"] is not None:
    L.append(f"compiled program: {e['compiled_over_model_flops']:.3f}x the model FLOPs per device; bytes accessed "
             f"{_fmt(e['bytes_accessed_over_state'], '.2f')}x the train state per device (XLA cost analysis)")
  b = rep["breakdown"]
  if b and b["available"]:
    L.append(f"top ops of {b['steps']} traced step(s), {b['ops_ms_per_step']:.2f} ms of ops per step:")
    for row in b["top"]:
      L.append(f"  {row['share']:6.1%} {row['ms_per_step']:9.3f} ms  {row['op']:<28} {row['jax_op'][-90:]}")
  elif b:
    L.append(f"breakdown: not available ({b['why']})")
  for name, q in rep["ratios"].items():
    L.append(f"ratio jaxtrain/{name} tokens/s: {q['median']:.3f}x median over {q['n']} rounds "
             f"[{q['min']:.3f}..{q['max']:.3f}]")
  return "\n".join(L)


def parse_baselines(text: str) -> list[str]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  if names == ["none"]:
    return []
  bad = [n for n in names if n not in BASELINES]
  if bad or not names or len(set(names)) != len(names):
    raise UserError(f"--baseline {text!r}: use none, or one or more of {', '.join(BASELINES)} separated by commas")
  return names


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if any(a == "--suite" or a.startswith("--suite=") for a in argv):  # the GPU checks became a pytest suite
    def moved(_):
      raise UserError("--suite gpu is now a pytest suite: run `python -m pytest -m gpu tests/gpu` in a source checkout")
    return cli.main("jaxtrain.bench", moved)
  args = parse_args(argv)

  def body(set_prog):
    from jaxtrain.core import config
    from jaxtrain.parallel import mesh as mesh_lib
    for flag, value, lo in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1)):
      if value < lo:
        raise UserError(f"{flag} {value}: must be an integer >= {lo}")
    baselines = parse_baselines(args.baseline)
    cfg = config.load(args.config, args.set)
    out = Path(args.out) if args.out else Path(args.workdir or Path("runs") / Path(args.config).stem) / "bench.json"
    if not args.out:
      from jaxtrain.run import runfiles
      runfiles.prepare_workdir(out.parent)
    if not out.parent.is_dir():  # checked before a long run, not after
      raise UserError(f"--out {args.out}: directory {str(out.parent)!r} does not exist")
    for name in baselines:
      check_baseline(cfg, name)
    if "torch" in baselines:
      # JAX would otherwise reserve 75% of GPU memory up front, leaving torch the rest.
      os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sizes = mesh_lib.parse(args.mesh)
    if -1 not in sizes.values():  # before the mesh is built: it may need simulated devices
      _check_one_device(baselines, args.mesh, math.prod(sizes.values()))
    started = cli.start(args, "jaxtrain.bench")  # the trainer's start-up: its XLA flags, its mesh
    if args.compare:
      return _compare(args, started.mesh, out, baselines)
    _check_one_device(baselines, args.mesh, started.mesh.size)
    rep = run(started.cfg, started.mesh, Path(args.config).stem, steps=args.steps, warmup=args.warmup,
              baselines=baselines, rounds=args.rounds, measure=args.measure_peak, breakdown=args.breakdown,
              trace_dir=out.parent / (out.stem + "-trace"))
    try:
      files.write_json_atomic(out, rep)
    except OSError as e:
      raise UserError(f"--out {args.out}: cannot write ({e.strerror})") from None
    print(f"wrote {out}")
    print(table(rep))
  return cli.main("jaxtrain.bench", body)


def _compare(args, mesh, out: Path, baselines) -> int:
  from jaxtrain.analysis import compare as bench_compare
  if baselines:
    raise UserError("--compare and --baseline do not mix; give one")
  variants = bench_compare.parse(args.compare)
  rep = bench_compare.run(args.config, args.set, variants, mesh, steps=args.steps, warmup=args.warmup,
                          rounds=args.rounds)
  try:
    files.write_json_atomic(out, rep)
  except OSError as e:
    raise UserError(f"--out {args.out}: cannot write ({e.strerror})") from None
  print(f"wrote {out}")
  print(bench_compare.table(rep))
  return 0


def _check_one_device(baselines: list[str], spec: str, devices: int) -> None:
  if baselines and devices != 1:
    raise UserError(f"--baseline {','.join(baselines)} runs on one device; the mesh {spec!r} has {devices} "
                    f"(use --mesh fsdp=1)")


def check_baseline(cfg, baseline: str) -> None:
  """What the baselines implement: one device, no microbatches, bf16 or fp32 compute."""
  if cfg.model.dtype not in ("bfloat16", "float32"):
    raise UserError(f"--baseline {baseline}: model.dtype={cfg.model.dtype} is not supported (no loss scaling in "
                    f"the baselines); use bfloat16 or float32")
  if cfg.train.microbatches != 1:
    raise UserError(f"--baseline {baseline}: train.microbatches={cfg.train.microbatches}; the baselines do not "
                    f"accumulate, use train.microbatches=1")
  if baseline == "torch":
    import importlib.util
    if importlib.util.find_spec("torch") is None:
      raise UserError("--baseline torch needs PyTorch: pip install 'jaxtrain[bench]'")


if __name__ == "__main__":
  sys.exit(main())
