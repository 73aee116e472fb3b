"""`python -m jaxtrain.bench --suite gpu`: every GPU figure the README asks for, in one command.

    python -m jaxtrain.bench --suite gpu [--tiny] [--checks a,b] [--budget 570] [--out FILE | --workdir DIR]

Checks, in this order (each independent; a failure is recorded with its one-line reason):
  attention        cuDNN fused attention (`attention.fused(..., implementation="cudnn")`, and the
                   packed-offsets layout on Hopper) against the float32 reference, outputs and
                   gradients, packed and unpacked rows; the same `fused` call with the XLA
                   implementation and the bfloat16 reference are measured alongside as controls.
  matmul_peak      the measured bf16 matmul throughput against `devices.TABLE`.
  remat_<policy>   each `model.remat` policy: step time, device peak memory, XLA's compiled memory.
  xla_flags        `run.xla_flags=gpu-default`: which flags this jaxlib accepts and drops, step time
                   with them against the same step without them.
  baseline_minimal jaxtrain vs the plain `jax.jit` step, rounds alternating (bench.run).
  baseline_torch   jaxtrain vs PyTorch (skipped when torch is not installed).
Shapes: the ~1B preset (`llama3-1b`, seq 2048, batch 1, one device) on a GPU; tiny shapes when
the backend is the CPU (or with --tiny). Tokens are synthetic (no data files, no grain).

Every check runs in a child process of this one (the parent never starts a backend): a crash
or a hung kernel is contained and timed out, a check gets a fresh allocator and peak-memory
counter (on a backend that keeps memory statistics a child runs one check and exits), and the
flag preset takes effect (XLA reads XLA_FLAGS once, when the backend starts). Children write
one JSON record per event to a records file the parent follows; their output goes to a log.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

from jaxtrain import cli
from jaxtrain.core import files
from jaxtrain.core.errors import UserError

REPORT_VERSION = 1
FULL = {"config": "llama3-1b", "set": ["train.seq_len=2048", "train.batch_size=1"], "steps": 20, "warmup": 3,
        "rounds": 3, "attention": (2, 1024, 16, 8, 128)}
# Tiny: the same layout as the full preset (scanned layers), sized so a CPU compiles it in seconds.
TINY = {"config": "tiny", "set": ["train.seq_len=32", "train.batch_size=2", "model.scan_layers=true"], "steps": 3,
        "warmup": 1, "rounds": 1, "attention": (2, 128, 4, 2, 32)}
SEGMENTS = 4  # documents per row in the packed attention layout
DEFAULT_BUDGET_S = 570.0  # the whole suite, inside 10 minutes
STARTUP_S = 180.0  # a child that has not started its first check by then is stopped


def remat_policies() -> tuple[str, ...]:
  from jaxtrain.core.config import ModelConfig
  return typing.get_args(typing.get_type_hints(ModelConfig)["remat"])


def all_checks() -> list[str]:
  """Cheapest first, so that a spent budget costs the fewest checks (the baselines compile a
  second program each, torch.compile the slowest)."""
  return ["attention", "matmul_peak", *(f"remat_{p}" for p in remat_policies()), "xla_flags",
          "baseline_minimal", "baseline_torch"]


def timeout_of(name: str) -> float:
  """Seconds one check may take (the suite's budget may cut it shorter)."""
  return {"attention": 120, "matmul_peak": 60, "baseline_minimal": 180, "baseline_torch": 240}.get(name, 120)


# ---------------------------------------------------------------------------------------------
# Child side: the checks themselves.


class Skip(Exception):
  """The check does not apply here (e.g. torch not installed)."""


class CheckFailed(Exception):
  """The check ran but its figures fail its criterion; the figures are kept."""

  def __init__(self, reason: str, result: dict):
    super().__init__(reason)
    self.result = result


def one_line(e: BaseException) -> str:
  text = " ".join(str(e).split()) or "(no message)"
  return f"{type(e).__name__}: {text[:400]}"


def synthetic_batches(cfg, n: int, seed: int = 0) -> list[dict]:
  """n batches of random tokens, one document per row (every side of every check can take them)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  B, L, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
  out = []
  for _ in range(n):
    tok = rng.integers(0, V, (B, L + 1), dtype=np.int32)
    out.append({"inputs": tok[:, :-1].copy(), "targets": tok[:, 1:].copy(), "loss_mask": np.ones((B, L), np.int32),
                "segment_ids": np.ones((B, L), np.int32),
                "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (B, L)).copy()})
  return out


def _shape(tiny: bool) -> dict:
  return TINY if tiny else FULL


def _config(tiny: bool, extra: list[str] = ()):
  from jaxtrain.core import config
  s = _shape(tiny)
  return config.load(s["config"], [*s["set"], *extra])


def _one_device_mesh(device):
  from jaxtrain.parallel import mesh as mesh_lib
  return mesh_lib.build(mesh_lib.parse("fsdp=1"), devices=[device])


def check_attention(tiny: bool, device) -> dict:
  """Relative error (max |x - truth| / max |truth|) of each kernel's output and gradients
  against the reference in float32 on the same bf16 inputs; a kernel passes when every error
  is within max(2 x the bf16 reference's own error, 1e-2)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jaxtrain.model import attention
  from jaxtrain.model import transformer as model
  from jaxtrain.parallel import devices
  B, L, H, K, E = _shape(tiny)["attention"]
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E)])
  g = jnp.asarray(rng.standard_normal((B, L, H, E)), jnp.bfloat16)  # the output cotangent
  layouts = {"unpacked": np.ones((B, L), np.int32),
             "packed": np.repeat(np.arange(1, B * SEGMENTS + 1).reshape(B, SEGMENTS), L // SEGMENTS, axis=1)}
  info = devices.of(device)
  kernels = {
      "reference_bf16": (lambda *a: model.attention(*a), None),
      "xla_fused": (lambda *a: attention.fused(*a, implementation="xla"), None),
      "cudnn": (lambda *a: attention.fused(*a, implementation="cudnn"), None if info.cuda else "no GPU"),
      "cudnn_packed_offsets": (lambda *a: attention.packed(*a, max_segments=SEGMENTS),
                               None if info.packed else "no GPU" if not info.cuda else
                               "needs compute capability >= 9.0"),
  }
  names = ("out", "dq", "dk", "dv")

  def run(f, dtype, seg):
    def fwd_bwd(q, k, v, g):
      out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
      return (out, *vjp(g.astype(out.dtype)))
    res = jax.jit(fwd_bwd)(*(x.astype(dtype) for x in (q, k, v, g)))
    return [np.asarray(r, np.float32) for r in res]

  result, failures = {"shape": {"B": B, "L": L, "H": H, "K": K, "E": E}, "segments_per_row_packed": SEGMENTS,
                      "criterion": "max|x-truth|/max|truth| per tensor <= max(2 x reference_bf16's, 1e-2); "
                                   "truth: jaxtrain.model.transformer.attention in float32"}, []
  for layout, seg in layouts.items():
    truth = run(model.attention, jnp.float32, jnp.asarray(seg))
    ref_out = None
    per = {}
    for kname, (f, skip) in kernels.items():
      if skip:
        per[kname] = {"status": "skipped", "reason": skip}
        continue
      got = run(f, jnp.bfloat16, jnp.asarray(seg))
      err = {n: float(np.max(np.abs(a - t)) / max(float(np.max(np.abs(t))), 1e-30))
             for n, a, t in zip(names, got, truth)}
      entry = {"status": "ok", "rel_error": err}
      if kname == "reference_bf16":
        ref_out, ref_err = got, err
      else:
        entry["max_abs_diff_vs_reference_bf16"] = {n: float(np.max(np.abs(a - r)))
                                                   for n, a, r in zip(names, got, ref_out)}
        bound = {n: max(2 * ref_err[n], 1e-2) for n in names}
        bad = [n for n in names if not err[n] <= bound[n]]  # NaN fails too
        if bad:
          entry["status"] = "failed"
          failures.append(f"{kname} {layout}: " + ", ".join(f"{n} {err[n]:.3g} > {bound[n]:.3g}" for n in bad))
      per[kname] = entry
    result[layout] = per
  if failures:
    raise CheckFailed("; ".join(failures), result)
  return result


def check_matmul_peak(tiny: bool, device) -> dict:
  from jaxtrain import bench
  from jaxtrain.parallel import devices
  m = bench.measure_peak(device)
  row = devices.of(device).entry
  table = row.peak_bf16_flops if row else None
  return {**m, "device_kind": device.device_kind, "table_peak_flops": table,
          "fraction_of_table": m["flops"] / table if table else None,
          "table_note": "jaxtrain.parallel.devices.TABLE (dense bf16 datasheet)" if table else
          f"device kind {device.device_kind!r} is not in jaxtrain.parallel.devices.TABLE"}


def check_baseline(name: str, tiny: bool, device) -> dict:
  from jaxtrain import bench
  if name == "torch":
    try:
      importlib.import_module("torch")
    except ImportError:
      raise Skip("torch not installed") from None
  cfg = _config(tiny, ["model.remat=none"])  # the baselines keep every activation: so does jaxtrain here
  bench.check_baseline(cfg, name)
  s = _shape(tiny)
  # torch.compile on a CPU takes longer than the whole tiny suite: eager there, compiled on a GPU.
  torch_compile = device.platform != "cpu"
  rep = bench.run(cfg, _one_device_mesh(device), s["config"], steps=s["steps"], warmup=s["warmup"],
                  baselines=[name], rounds=s["rounds"], measure=False,
                  batches=synthetic_batches(cfg, min(s["steps"], 4)), torch_compile=torch_compile)
  out = {k: rep[k] for k in ("config", "batch_size", "seq_len", "compute_dtype", "batch", "steps", "rounds",
                             "flops_per_step", "peak_flops_per_device")}
  out.update(remat="none", jaxtrain=rep["jaxtrain"], baseline=rep["baseline_results"][name], ratio=rep["ratios"][name])
  if name == "torch":
    out["torch_compile"] = torch_compile
  return out


def measure_step(tiny: bool, device, remat: str) -> dict:
  """jaxtrain's step alone at the suite's shape with `remat`: step time, peak and compiled memory."""
  import jax
  import numpy as np
  from jaxtrain import bench
  from jaxtrain.model import flops
  from jaxtrain.run import step as step_lib
  cfg = _config(tiny, [f"model.remat={remat}"])
  s = _shape(tiny)
  setup = step_lib.Setup(cfg, _one_device_mesh(device))
  batches = synthetic_batches(cfg, min(s["steps"], 4))
  side = bench.jaxtrain_side(cfg, setup, batches)
  for _ in range(s["warmup"]):
    side.sync(side.run())
  times = bench.time_steps(side.run, side.sync, s["steps"])
  loss = float(jax.device_get(side.sync(side.run())))
  peak = bench.device_peak_memory(side.devices)
  from jaxtrain.analysis import gpu_compile
  m = gpu_compile.CompiledMemory.of(side.box["compiled"])
  compiled = (dict(argument=m.arguments, output=m.outputs, alias=m.aliased, temp=m.temporaries) if m else None)
  t = cfg.train
  fl = flops.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
  table = flops.peak_flops(device.device_kind)
  res = {"config": s["config"], "remat": remat, "attention": setup.plan.attention, "batch_size": t.batch_size,
         "seq_len": t.seq_len, "compile_s": side.compile_s, "step_time_s": bench.stats(times),
         "tokens_per_s": float(t.batch_size * t.seq_len / np.median(times)),
         "mfu": fl / float(np.median(times)) / table if table else None,
         "peak_memory_bytes": peak,
         "memory_note": "device.memory_stats() peak_bytes_in_use of this process (one check per process)"
         if peak is not None else f"not reported by the {device.platform} backend",
         "compiled_memory_bytes": compiled, "loss_after": loss, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  if not math.isfinite(loss):
    raise CheckFailed(f"loss is {loss} after {s['warmup'] + s['steps'] + 1} steps", res)
  return res


def run_check(name: str, tiny: bool, device) -> dict:
  if name == "attention":
    return check_attention(tiny, device)
  if name == "matmul_peak":
    return check_matmul_peak(tiny, device)
  if name.startswith("baseline_"):
    return check_baseline(name.removeprefix("baseline_"), tiny, device)
  if name.startswith("remat_"):
    return measure_step(tiny, device, name.removeprefix("remat_"))
  if name in ("xla_flags_on", "xla_flags_off"):  # the parent sets (or not) the preset's XLA_FLAGS
    return measure_step(tiny, device, "none")
  raise ValueError(f"unknown check {name!r}")


def child_main(argv) -> int:
  p = argparse.ArgumentParser(prog="jaxtrain.analysis.bench_gpu --child")
  p.add_argument("--child", required=True, help="comma-separated checks to run")
  p.add_argument("--tiny", choices=("auto", "yes"), default="auto")
  p.add_argument("--records", required=True)
  args = p.parse_args(argv)
  with open(args.records, "a", buffering=1) as rec:
    def emit(**kw):
      rec.write(json.dumps(kw) + "\n")
      rec.flush()
    import jax
    device = jax.devices()[0]
    tiny = args.tiny == "yes" or device.platform == "cpu"
    emit(event="env", platform=device.platform, device_kind=device.device_kind, jax=jax.__version__, tiny=tiny,
         devices=jax.device_count())
    # Where the backend keeps memory statistics, each check gets a fresh process (fresh peak counter).
    isolate = (device.memory_stats() or None) is not None
    for name in args.child.split(","):
      emit(event="start", check=name)
      t = time.perf_counter()
      status, reason, result = "ok", None, None
      try:
        result = run_check(name, tiny, device)
      except Skip as e:
        status, reason = "skipped", str(e)
      except CheckFailed as e:
        status, reason, result = "failed", str(e), e.result
      except BaseException as e:  # noqa: BLE001 - recorded, the other checks still run
        status, reason = "failed", one_line(e)
      emit(event="done", check=name, status=status, reason=reason, result=result, wall_s=time.perf_counter() - t)
      if isolate:
        break
  return 0


# ---------------------------------------------------------------------------------------------
# Parent side: children, time limits, the report.


class Runner:
  """Starts children for pending checks and follows their records, enforcing the time limits."""

  def __init__(self, out: Path, tiny: bool, budget_s: float):
    self.records, self.log = out.with_name(out.stem + ".records.jsonl"), out.with_name(out.stem + ".log")
    self.records.write_text("")
    self.log.write_text("")
    # One compilation cache for the suite's children, new each run and removed after it: the
    # first child compiles a program, a later one running the same program (jaxtrain's step
    # with remat none is in remat_none and the baselines) loads it. XLA_FLAGS are part of the
    # cache key, so the run with the flag preset compiles afresh.
    self.cache = out.with_name(out.stem + ".jax-cache")
    shutil.rmtree(self.cache, ignore_errors=True)
    self.tiny, self.budget_s, self.t0 = tiny, budget_s, time.monotonic()
    self.env_info: dict | None = None
    self.results: dict[str, dict] = {}

  def left(self) -> float:
    return self.budget_s - (time.monotonic() - self.t0)

  def run(self, names: list[str], env: dict | None = None) -> None:
    pending = list(names)
    while pending:
      if self.left() <= 1:
        for n in pending:
          self.results[n] = {"status": "skipped", "reason": f"suite time budget of {self.budget_s:.0f} s spent",
                             "result": None, "wall_s": 0.0}
        return
      pending = self._child(pending, env)

  def _child(self, pending: list[str], env: dict | None) -> list[str]:
    cmd = [sys.executable, "-m", "jaxtrain.analysis.bench_gpu", "--child", ",".join(pending), "--records", str(self.records),
           "--tiny", "yes" if self.tiny else "auto"]
    full_env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_COMPILATION_CACHE_DIR": str(self.cache),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **(env or {})}
    offset, log_offset = self.records.stat().st_size, self.log.stat().st_size
    with self.log.open("a") as log:
      log.write(f"$ {' '.join(cmd)}\n")
      log.flush()
      proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started, current, cur_t0, stop_reason = time.monotonic(), None, None, None
    while True:
      exited = proc.poll() is not None
      with self.records.open() as f:
        f.seek(offset)
        lines = f.readlines()
      for line in lines:
        if not line.endswith("\n"):
          break  # a record still being written
        offset += len(line.encode())
        r = json.loads(line)
        if r["event"] == "env":
          self.env_info = self.env_info or {k: v for k, v in r.items() if k != "event"}
        elif r["event"] == "start":
          current, cur_t0 = r["check"], time.monotonic()
          print(f"bench --suite gpu: {current} ...", flush=True)
        elif r["event"] == "done":
          self.results[r["check"]] = {k: r[k] for k in ("status", "reason", "result", "wall_s")}
          pending.remove(r["check"])
          current = None
      if exited:
        break
      now = time.monotonic()
      if current is not None and (now - cur_t0 > timeout_of(current) or self.left() <= 0):
        stop_reason = (f"timed out after {now - cur_t0:.0f} s" if now - cur_t0 > timeout_of(current) else
                       f"stopped after {now - cur_t0:.0f} s: suite time budget of {self.budget_s:.0f} s spent")
      elif current is None and self.left() <= 0:
        stop_reason = "budget"
      elif current is None and now - started > STARTUP_S:
        stop_reason = f"the child process did not start the check within {now - started:.0f} s"
      if stop_reason:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started (its own session)
        proc.wait()
        break
      time.sleep(0.1)
    tail = self._log_tail(log_offset)
    if stop_reason == "budget":  # between two checks: the rest are skipped by run()
      return pending
    if current is not None:  # started, never finished
      reason = stop_reason or f"the child process died (exit {proc.returncode}): {tail}"
      self.results[current] = {"status": "failed", "reason": reason, "result": None,
                               "wall_s": time.monotonic() - cur_t0}
      pending.remove(current)
    elif stop_reason or (proc.returncode != 0 and pending):
      # Nothing started in this child: it could not start at all; the same would happen again.
      why = stop_reason or f"the child process failed (exit {proc.returncode}): {tail}"
      for n in pending:
        self.results[n] = {"status": "failed", "reason": why, "result": None, "wall_s": 0.0}
      return []
    return pending

  def _log_tail(self, offset: int) -> str:
    with self.log.open("rb") as f:
      f.seek(offset)
      lines = [l.strip() for l in f.read().decode(errors="replace").splitlines() if l.strip()]
    return lines[-1][:400] if lines else "(no output)"


def run_flags(runner: Runner) -> dict:
  """The gpu-default preset: this jaxlib's verdict per flag, then the step with and without."""
  from jaxtrain.parallel import xla_flags
  t = time.monotonic()
  have = os.environ.get("XLA_FLAGS", "").split()
  taken = {xla_flags.name_of(f) for f in have}
  preset = xla_flags.PRESETS["gpu-default"]
  candidates = [f for f in preset if xla_flags.name_of(f) not in taken]
  try:
    kept, dropped = xla_flags.validate(candidates)
  except Exception as e:  # noqa: BLE001
    return {"status": "failed", "reason": f"validating the flags: {one_line(e)}", "result": None,
            "wall_s": time.monotonic() - t}
  result = {"preset": "gpu-default", "accepted": kept, "dropped": dropped,
            "already_in_XLA_FLAGS": [f for f in preset if xla_flags.name_of(f) in taken]}
  base = runner.results.get("remat_none")
  if base and base["status"] == "ok":
    without, result["without_source"] = base, "the remat_none check (the same step, no preset flags)"
  else:
    runner.run(["xla_flags_off"])
    without, result["without_source"] = runner.results.pop("xla_flags_off"), "its own run (no preset flags)"
  runner.run(["xla_flags_on"], {"XLA_FLAGS": " ".join(have + kept)})
  with_ = runner.results.pop("xla_flags_on")
  result["with"], result["without"] = with_["result"], without["result"]
  bad = [f"{side}: {r['status']}: {r['reason']}" for side, r in (("with", with_), ("without", without))
         if r["status"] != "ok"]
  if not bad:
    a, b = with_["result"]["step_time_s"]["median"], without["result"]["step_time_s"]["median"]
    result["step_time_ratio_with_over_without"] = a / b
  return {"status": "failed" if bad else "ok", "reason": "; ".join(bad) or None, "result": result,
          "wall_s": time.monotonic() - t}


def parse_args(argv):
  p = cli.Parser(prog="jaxtrain.bench --suite gpu",
                 description="Run the GPU checks (attention kernels, matmul peak, baselines, remat policies, XLA "
                             "flags) and write one JSON report.")
  p.add_argument("--suite", required=True, choices=["gpu"], help="the suite to run")
  p.add_argument("--tiny", action="store_true", help="tiny shapes even on a GPU (default: tiny only on a CPU backend)")
  p.add_argument("--checks", help="comma-separated subset of the checks (default: all)")
  p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                 help=f"seconds for the whole suite; checks left when it is spent are skipped (default "
                      f"{DEFAULT_BUDGET_S:.0f})")
  p.add_argument("--out", help="JSON report (default <workdir>/gpu-suite.json)")
  p.add_argument("--workdir", default=str(Path("runs") / "gpu-suite"), help="default: runs/gpu-suite")
  return p.parse_args(argv)


def run_suite(args) -> tuple[Path, dict]:
  known = all_checks()
  checks = known if not args.checks else [c.strip() for c in args.checks.split(",") if c.strip()]
  bad = [c for c in checks if c not in known]
  if bad or not checks or len(set(checks)) != len(checks):
    what = f"unknown {', '.join(bad)}" if bad else "empty" if not checks else "a check is named twice"
    raise UserError(f"--checks {args.checks!r}: {what}; choose from {', '.join(known)}")
  if not args.budget > 0:
    raise UserError(f"--budget {args.budget}: must be a number of seconds > 0")
  out = Path(args.out) if args.out else Path(args.workdir) / "gpu-suite.json"
  if not args.out:
    from jaxtrain.run import runfiles
    runfiles.prepare_workdir(out.parent)
  if not out.parent.is_dir():
    raise UserError(f"--out {args.out}: directory {str(out.parent)!r} does not exist")
  started = time.time()
  runner = Runner(out, args.tiny, args.budget)
  if "xla_flags" in checks:  # run by this process, at its place in the order
    i = checks.index("xla_flags")
    runner.run(checks[:i])
    runner.results["xla_flags"] = run_flags(runner)
    runner.run(checks[i + 1:])
  else:
    runner.run(checks)
  shutil.rmtree(runner.cache, ignore_errors=True)  # of use to this run only
  env = runner.env_info or {}
  rep = {"suite": "gpu", "version": REPORT_VERSION, "started_unix": started, "wall_s": time.time() - started,
         "budget_s": args.budget, "tiny": env.get("tiny"), "platform": env.get("platform"),
         "device_kind": env.get("device_kind"), "jax": env.get("jax"),
         "shapes": _shape(bool(env.get("tiny"))) if env else None,
         "log": str(runner.log),
         "compilation_cache": "compile_s is the time to compile, or to load the program from the suite's own "
                              f"compilation cache ({runner.cache}) when an earlier check compiled it",
         "checks": {c: runner.results[c] for c in checks}}
  try:
    files.write_json_atomic(out, rep)
  except OSError as e:
    raise UserError(f"--out {out}: cannot write ({e.strerror})") from None
  return out, rep


def _ms(st) -> str:
  return f"{st['median'] * 1e3:.2f} ms"


def _bytes(b) -> str:
  return "n/a" if b is None else f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def summary(name: str, r: dict) -> str:
  """The one-line figures of a finished check."""
  if name == "attention":
    parts = []
    for layout in ("unpacked", "packed"):
      for k, e in r[layout].items():
        if k != "reference_bf16" and e["status"] != "skipped":
          parts.append(f"{k}/{layout} {max(e['rel_error'].values()):.2g}")
    ref = max(max(r[l]["reference_bf16"]["rel_error"].values()) for l in ("unpacked", "packed"))
    skipped = sorted({f"{k}: {e['reason']}" for l in ("unpacked", "packed") for k, e in r[l].items()
                      if e["status"] == "skipped"})
    return (f"max rel error vs f32: {', '.join(parts)} (bf16 reference {ref:.2g})"
            + (f"; skipped {'; '.join(skipped)}" if skipped else ""))
  if name == "matmul_peak":
    frac = (f" = {r['fraction_of_table']:.1%} of the table's {r['table_peak_flops'] / 1e12:.0f}"
            if r["fraction_of_table"] else "")
    return f"{r['tflops']:.4g} TFLOP/s (bf16 {r['size']}^3){frac}"
  if name.startswith("baseline_"):
    q = r["ratio"]
    eager = " (eager)" if r.get("torch_compile") is False else ""
    return (f"jaxtrain {_ms(r['jaxtrain']['step_time_s'])}, {name.removeprefix('baseline_')}{eager} "
            f"{_ms(r['baseline']['step_time_s'])}; jaxtrain/baseline tokens/s {q['median']:.3f}x")
  if name.startswith("remat_"):
    cm = r["compiled_memory_bytes"]
    return (f"{_ms(r['step_time_s'])}, peak {_bytes(r['peak_memory_bytes'])}, compiled temp "
            f"{_bytes(cm['temp'] if cm else None)}, attention {r['attention']}")
  if name == "xla_flags":
    ratio = r.get("step_time_ratio_with_over_without")
    times = (f"; step {_ms(r['without']['step_time_s'])} without, {_ms(r['with']['step_time_s'])} with "
             f"({ratio:.3f}x)") if ratio else ""
    return f"{len(r['accepted'])} accepted, {len(r['dropped'])} dropped{times}"
  return ""


def table(rep: dict, out: Path) -> str:
  shape = "tiny shapes" if rep["tiny"] else f"{rep['shapes']['config']} shapes" if rep["shapes"] else "?"
  L = [f"jaxtrain.bench --suite gpu: {rep['device_kind']} ({rep['platform']}, jax {rep['jax']}), {shape}, "
       f"{rep['wall_s']:.0f} s; report {out}"]
  for name, c in rep["checks"].items():
    if c["status"] == "ok":
      text = summary(name, c["result"])
    else:
      text = c["reason"] or ""
    L.append(f"{name:<22} {c['status']:<8} {text}")
  return "\n".join(L)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)

  def body(set_prog):
    out, rep = run_suite(args)
    print(f"wrote {out}")
    print(table(rep, out))
  return cli.main("jaxtrain.bench --suite gpu", body)


if __name__ == "__main__":
  argv = sys.argv[1:]
  sys.exit(child_main(argv) if "--child" in argv else main(argv))
