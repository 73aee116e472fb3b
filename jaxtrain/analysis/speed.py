"""The train step's speed beside baselines for `python -m jaxtrain.bench` (docs/performance.md),
and the step timer and alternating rounds that `bench --compare` shares."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from jaxtrain.core.errors import UserError

BASELINES = ("minimal", "torch")


def stats(xs) -> dict:
  import numpy as np
  a = np.asarray(xs, float)
  return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
          "p25": float(np.percentile(a, 25)), "p75": float(np.percentile(a, 75)), "n": int(a.size)}


def time_steps(run, sync, n: int, pipelined: bool = True) -> list[float]:
  """Seconds of each of n steps: `run()` dispatches one and returns a handle, `sync(handle)` waits.
  Pipelined: step s's end is awaited with s+1 already queued (the trainer's clock); otherwise
  (`run` returns when the step is done: torch on CPU) each step is timed alone."""
  times = []
  if not pipelined:
    for _ in range(n):
      t = time.perf_counter()
      sync(run())
      times.append(time.perf_counter() - t)
    return times
  last, pending = time.perf_counter(), run()
  for k in range(n):
    queued = run() if k < n - 1 else None
    sync(pending)
    now = time.perf_counter()
    times.append(now - last)
    last, pending = now, queued
  return times


def first_batches(cfg, setup, n: int, unpacked: bool) -> list[dict]:
  """The first n numpy batches of this process from jaxtrain's data path; `unpacked`: the same
  tokens with each row one document (one segment, positions 0..L-1)."""
  import contextlib
  import numpy as np
  from jaxtrain import data
  with contextlib.closing(data.batches(cfg, *setup.placement.rows())) as it:
    out = [next(it) for _ in range(n)]
  if not unpacked:
    return out
  B, L = out[0]["inputs"].shape
  return [{**b, "segment_ids": np.ones((B, L), np.int32),
           "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()} for b in out]


def measure_peak(device, size: int | None = None, reps: int = 5) -> dict:
  """Best bf16 n x n x n matmul throughput of one device over a few timed repeats, FLOP/s."""
  import jax
  import jax.numpy as jnp
  n = size or {"gpu": 8192, "tpu": 8192}.get(device.platform, 1024)
  a, b = (jax.device_put(jax.random.normal(k, (n, n), jnp.bfloat16), device)
          for k in jax.random.split(jax.random.key(0)))
  mm = jax.jit(lambda x, y: x @ y)
  mm(a, b).block_until_ready()
  inner, best = (10 if device.platform != "cpu" else 2), 0.0
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
  """One trainer under test: `run()` dispatches step i on batch i % len(batches) and returns
  its loss, `sync(loss)` waits for it. box: {"state", "i": steps dispatched, "compiled"}."""

  def __init__(self, name, step, state, batches, sync, devices, compile_s=0.0, compiled=None, pipelined=True):
    self.name, self.step, self.batches, self.sync, self.devices = name, step, batches, sync, devices
    self.compile_s, self.pipelined, self.box = compile_s, pipelined, {"state": state, "i": 0, "compiled": compiled}
    self.times, self.timed = [], []  # seconds and step index (box["i"]) of each timed step
    self.peak_memory, self.memory_note = None, ""
    self.baseline: str | None = None  # a --baseline's name: its out-of-memory is named (baseline_fits)

  def run(self):
    self.box["state"], loss = self.step(self.box["state"], self.batches[self.box["i"] % len(self.batches)])
    self.box["i"] += 1
    return loss

  def untimed(self, n: int) -> None:
    for _ in range(n):
      self.sync(self.run())


def _jit_side(name, jitted, state, batches, devices) -> _Side:
  """`jitted(state, batch)` compiled ahead of time (the compile timed), state donated."""
  import jax
  t = time.perf_counter()
  compiled = jitted.lower(state, batches[0]).compile()
  compile_s = time.perf_counter() - t

  def step(s, batch):
    s, out = compiled(s, batch)
    return s, out["loss"] if isinstance(out, dict) else out
  return _Side(name, step, state, batches, jax.block_until_ready, devices, compile_s, compiled)


def jaxtrain_side(cfg, setup, batches, state=None) -> _Side:  # the state, then the batches, on the devices
  return _jit_side("jaxtrain", setup.step, setup.init() if state is None else state,
                   [setup.device_batch(b) for b in batches], list(setup.mesh.devices.flat))


def minimal_side(cfg, params, batches, device) -> _Side:
  import jax
  import jax.numpy as jnp
  from jaxtrain.analysis.baselines import minimal
  b = minimal.Minimal(cfg)
  return _jit_side("minimal", b.step, b.init(params, device),
                   [{k: jax.device_put(jnp.asarray(v), device) for k, v in x.items()} for x in batches], [device])


def torch_side(cfg, params, batches, platform) -> _Side:
  from jaxtrain.analysis.baselines import torch_model  # imports torch; only here
  try:
    b = torch_model.TorchBaseline(cfg, params, "cuda" if platform == "gpu" else "cpu")
  except ValueError as e:
    raise UserError(f"--baseline torch: {e}") from None
  side = _Side("torch", lambda _, batch: (None, b.step(batch)), None, [b.to_device(x) for x in batches],
               lambda loss: loss.item(), [], pipelined=b.device.type == "cuda")  # CPU torch runs each step eagerly
  t = time.perf_counter()
  side.run().item()  # torch.compile compiles on the first call: that call's time is the compile time
  side.compile_s, side.torch_baseline = time.perf_counter() - t, b
  return side


@contextlib.contextmanager
def baseline_fits(name: str | None):
  """Baseline `name`'s device out-of-memory (its compile, state or steps) as one line naming it; None (jaxtrain's
  own step, a --compare variant): left to the commands' epilogue, which gives the bill (fit.out_of_memory)."""
  from jaxtrain.analysis import fit
  try:
    yield
  except Exception as e:
    if name is None or (first := fit.oom_line(e)) is None:
      raise
    raise UserError(f"--baseline {name} does not fit on the device: out of memory running the {name} baseline "
                    f"({first}); it is a plain step with no remat or sharding: lower train.batch_size or "
                    f"train.seq_len, or leave out --baseline {name}") from None


def alternate(sides, *, steps: int, warmup: int, rounds: int, on_round=lambda r: None,
              on_timed=lambda side, r: None) -> dict:
  """`warmup` untimed steps of each side, then `rounds` rounds of `steps` timed steps of each side
  in turn (a machine's drift hits every side alike); {side name: median step time of each round}."""
  import numpy as np
  for side in sides:
    with baseline_fits(side.baseline):
      side.untimed(warmup)
  medians = {side.name: [] for side in sides}
  for r in range(rounds):
    on_round(r)
    for side in sides:
      first = side.box["i"]
      with baseline_fits(side.baseline):
        times = time_steps(side.run, side.sync, steps, side.pipelined)
      side.times += times
      side.timed += range(first, first + steps)
      medians[side.name].append(float(np.median(times)))
      on_timed(side, r)
  return medians


def summarize(side: _Side, valid: list[int], flops_per_step: float, n_devices: int, peak: float | None,
              measured: float | None) -> dict:
  per_dev = [flops_per_step / s / n_devices for s in side.times]
  tokens = [valid[i % len(valid)] for i in side.timed]
  return {"compile_s": side.compile_s, "step_time_s": stats(side.times),
          "tokens_per_s": stats([n / s for n, s in zip(tokens, side.times)]),
          "tflops_per_device": stats([f / 1e12 for f in per_dev]),
          "mfu": stats([f / peak for f in per_dev]) if peak else None,
          "mfu_vs_measured_peak": stats([f / measured for f in per_dev]) if measured else None,
          "peak_memory_bytes": side.peak_memory, "memory_note": side.memory_note, "devices": n_devices}


def _baseline_sides(cfg, setup, batches, baselines: list[str], dev0, progress) -> list:
  """The baselines' sides, each starting from jaxtrain's initial weights (fetched before any step donates them)."""
  if not baselines:
    return []
  import jax
  from jaxtrain.analysis import baselines as baselines_lib
  params0 = baselines_lib.layer_list(jax.device_get(setup.init()["params"]), cfg.model.n_layers)
  out = []
  for name in baselines:
    progress(f"compiling the {name} baseline")
    with baseline_fits(name):
      out.append(minimal_side(cfg, params0, batches, dev0) if name == "minimal"
                 else torch_side(cfg, params0, batches, dev0.platform))
    out[-1].baseline = name
  return out


def _note_peak_memory(side, first_round: bool, last_round: bool, platform: str) -> None:
  """Peak memory: jaxtrain's before any baseline's timed step, torch's after its last."""
  if side.name == "jaxtrain" and first_round:
    side.peak_memory = device_peak_memory(side.devices)
    side.memory_note = ("device.memory_stats() peak_bytes_in_use, max over devices" if side.peak_memory is not None
                        else f"not reported by the {platform} backend")
  elif side.name == "torch" and last_round:
    side.peak_memory = side.torch_baseline.peak_memory()
    side.memory_note = ("torch.cuda.max_memory_allocated()" if side.peak_memory is not None
                        else "not reported for torch on CPU")
  elif side.name == "minimal":
    side.memory_note = "not separable: shares the device (and its peak counter) with jaxtrain"


def run(cfg, mesh, config_name: str, *, steps: int, warmup: int, baselines: list[str], rounds: int,
        measure: bool, breakdown: int = 0, trace_dir: Path | None = None, batches: list[dict] | None = None) -> dict:
  """`batches`: numpy batches to cycle instead of jaxtrain.data's (e.g. synthetic tokens, tests/gpu)."""
  import jax
  from jaxtrain.analysis import costs, fit, memory
  from jaxtrain.model import flops
  from jaxtrain.parallel import devices
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import step as step_lib
  from jaxtrain import data
  from jaxtrain.parallel import kernels
  unpacked = "torch" in baselines  # SDPA's flash path masks causally only: every side gets unpacked rows
  if batches is not None:
    segments = max(int(kernels.segments_per_row(b["segment_ids"]).max()) for b in batches)
    unpacked = unpacked or segments == 1
  setup = step_lib.Setup(cfg, mesh, segments=1 if unpacked else
                         segments if batches is not None else data.most_segments(cfg, min(steps, 4)))
  cfg = setup.cfg  # with what the mesh implies
  fit.check(setup, cfg.run.fit_check)
  dev0, t = mesh.devices.flat[0], cfg.train
  if batches is None:
    batches = first_batches(cfg, setup, min(steps, 4), unpacked)
  valid = [int((b["loss_mask"] > 0).sum()) for b in batches]
  flops_per_step = flops.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
  peak = devices.peak_flops(dev0.device_kind)
  measured = measure_peak(dev0) if measure else None
  n_rounds = rounds if baselines else 1
  progress = lambda text: print(f"bench: {text}", flush=True)  # noqa: E731 (long work gets a line, not a silent minute)
  progress(f"compiling the jaxtrain step ({config_name}, mesh {mesh_lib.describe(dict(mesh.shape))})")
  sides = [jaxtrain_side(cfg, setup, batches), *_baseline_sides(cfg, setup, batches, baselines, dev0, progress)]
  on_timed = lambda side, r: _note_peak_memory(side, r == 0, r == n_rounds - 1, dev0.platform)  # noqa: E731
  medians = alternate(sides, steps=steps, warmup=warmup, rounds=n_rounds, on_timed=on_timed,
                      on_round=lambda r: progress(f"timing round {r + 1}/{n_rounds}: {steps} steps per side"))
  # same batches: step-time ratio = tokens/s ratio
  per_round = {name: [b / j for b, j in zip(medians[name], medians["jaxtrain"])] for name in baselines}

  compiled = sides[0].box["compiled"]
  eff = costs.efficiency(compiled, flops_per_step / mesh.size, sum(memory.state_bytes(setup).values()))
  top = costs.breakdown(sides[0].untimed, min(steps, 3), compiled.as_text(), breakdown, trace_dir) if breakdown else None
  mflops = measured and measured["flops"]
  return {
      "config": config_name, "mesh": mesh_lib.describe(dict(mesh.shape)), "devices": mesh.size,
      "platform": dev0.platform, "device_kind": dev0.device_kind, "batch_size": t.batch_size, "seq_len": t.seq_len,
      "compute_dtype": cfg.model.dtype, "fp8": cfg.model.fp8, "batch": "one document per row" if unpacked else "packed",
      "steps": steps, "warmup": warmup, "rounds": n_rounds, "baselines": baselines,
      "valid_tokens_per_step": stats(valid),
      "flops_per_token": flops_per_step / (t.batch_size * t.seq_len), "flops_per_step": flops_per_step,
      "flops_formula": "jaxtrain.model.flops.flops_per_token (as in jaxtrain.inspect)",
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "peak_flops_per_device": peak, "peak_source": "jaxtrain.parallel.devices.TABLE" if peak else
      f"unknown for device kind {dev0.device_kind!r}: MFU is null",
      "measured_peak": measured, "efficiency": eff, "breakdown": top,
      "jaxtrain": summarize(sides[0], valid, flops_per_step, mesh.size, peak, mflops),
      "baseline_results": {s.name: summarize(s, valid, flops_per_step, 1, peak, mflops) for s in sides[1:]},
      "ratios": {name: {**stats(q), "per_round": q,
                        "meaning": f"jaxtrain tokens/s / {name} tokens/s, from the median step time of each round"}
                 for name, q in per_round.items()},
  }


def _fmt(x, spec):
  return "n/a" if x is None else format(x, spec)


def table(rep: dict) -> str:
  from jaxtrain.model import flops
  rows = [("jaxtrain", rep["jaxtrain"]), *rep["baseline_results"].items()]
  L = [f"jaxtrain.bench: {rep['config']} on {rep['mesh']} ({rep['devices']} x {rep['device_kind']}), "
       f"batch {rep['batch_size']} x {rep['seq_len']} ({rep['batch']}), {rep['compute_dtype']}"
       f"{flops.fp8_label(rep.get('fp8', 'none'))}, "
       f"{rep['steps']} steps x {rep['rounds']} round(s)",
       f"{'':<9} {'step ms: median [min..max]':<28} {'tokens/s':>11} {'TFLOP/s/dev':>11} {'MFU':>6} "
       f"{'compile s':>9} {'peak mem':>10}"]
  for name, r in rows:
    st, mfu, mem = r["step_time_s"], r["mfu"] and r["mfu"]["median"], r["peak_memory_bytes"]
    steps = f"{st['median'] * 1e3:.2f} [{st['min'] * 1e3:.2f}..{st['max'] * 1e3:.2f}]"
    L.append(f"{name:<9} {steps:<28} {r['tokens_per_s']['median']:>11,.0f} {r['tflops_per_device']['median']:>11.4g} "
             f"{_fmt(mfu, '.1%'):>6} {r['compile_s']:>9.1f} {'n/a' if mem is None else f'{mem / 2**30:.2f} GiB':>10}")
  if rep.get("fp8", "none") != "none":
    L.append(flops.FP8_MFU_NOTE)
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
    L += [f"  {row['share']:6.1%} {row['ms_per_step']:9.3f} ms  {row['op']:<28} {row['jax_op'][-90:]}" for row in b["top"]]
  elif b:
    L.append(f"breakdown: not available ({b['why']})")
  for name, q in rep["ratios"].items():
    L.append(f"ratio jaxtrain/{name} tokens/s: {q['median']:.3f}x median over {q['n']} rounds "
             f"[{q['min']:.3f}..{q['max']:.3f}]")
  return "\n".join(L)


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
