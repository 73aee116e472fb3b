"""What the GPU tests share: their shapes, synthetic batches, and the measurements that run
in a child process of their own, `python -m tests.gpu.checks step|baseline NAME --out FILE`.

A child gets a fresh allocator and peak-memory counter (`peak_bytes_in_use` is per
process), its own XLA_FLAGS (XLA reads them once, when the backend starts), and a crash or
a hung kernel costs one test. It writes its figures as JSON to --out; the test judges them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The ~1B preset on one device, batch 1 at seq 2048; tiny: the same layout (scanned layers)
# sized so that a CPU compiles it in seconds (JAXTRAIN_GPU_TESTS=tiny, see conftest.py).
FULL = {"config": "llama3-1b", "set": ["train.seq_len=2048", "train.batch_size=1"], "steps": 20, "warmup": 3,
        "rounds": 3, "attention": (2, 1024, 16, 8, 128)}
TINY = {"config": "tiny", "set": ["train.seq_len=32", "train.batch_size=2", "model.scan_layers=true"], "steps": 3,
        "warmup": 1, "rounds": 1, "attention": (2, 128, 4, 2, 32)}
# What jaxtrain sets to do a baseline's math: torch's autocast head returns bfloat16 logits.
SAME_MATH = {"torch": ["model.head_logits_dtype=bfloat16"]}
# Seconds a child may take.
TIMEOUT_S = {"step": 120, "baseline:minimal": 180, "baseline:torch": 240}


def tiny_requested() -> bool:
  return os.environ.get("JAXTRAIN_GPU_TESTS") == "tiny"


def shape(tiny: bool) -> dict:
  return TINY if tiny else FULL


def load_config(tiny: bool, extra=()):
  from jaxtrain.core import config
  s = shape(tiny)
  return config.load(s["config"], [*s["set"], *extra])


def one_device_mesh(device):
  from jaxtrain.parallel import mesh as mesh_lib
  return mesh_lib.build(mesh_lib.parse("fsdp=1"), devices=[device])


def synthetic_batches(cfg, n: int, seed: int = 0) -> list[dict]:
  """n batches of random tokens, one document per row (both baselines take them)."""
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


def measure_step(tiny: bool, device, remat: str) -> dict:
  """jaxtrain's step alone with `remat`: step time, tokens/s, MFU, peak and compiled memory, loss."""
  import jax
  import numpy as np
  from jaxtrain.analysis import speed as bench
  from jaxtrain.analysis import gpu_compile
  from jaxtrain.model import flops
  from jaxtrain.parallel import devices
  from jaxtrain.run import step as step_lib
  cfg = load_config(tiny, [f"model.remat={remat}"])
  s = shape(tiny)
  setup = step_lib.Setup(cfg, one_device_mesh(device))
  side = bench.jaxtrain_side(cfg, setup, synthetic_batches(cfg, min(s["steps"], 4)))
  for _ in range(s["warmup"]):
    side.sync(side.run())
  times = bench.time_steps(side.run, side.sync, s["steps"])
  loss = float(jax.device_get(side.sync(side.run())))
  peak = bench.device_peak_memory(side.devices)
  ma = gpu_compile.CompiledMemory.of(side.box["compiled"])
  t = cfg.train
  median = float(np.median(times))
  fl = flops.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
  table = devices.peak_flops(device.device_kind)
  return {"config": s["config"], "remat": remat, "attention": setup.plan.attention, "batch_size": t.batch_size,
          "seq_len": t.seq_len, "compile_s": side.compile_s, "step_time_s": bench.stats(times),
          "tokens_per_s": t.batch_size * t.seq_len / median, "mfu": fl / median / table if table else None,
          "peak_memory_bytes": peak, "compiled_memory_bytes":
          {"argument": ma.arguments, "output": ma.outputs, "alias": ma.aliased, "temp": ma.temporaries} if ma else None,
          "loss_after": loss, "steps_before_loss": s["warmup"] + s["steps"] + 1,
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def measure_baseline(tiny: bool, device, name: str) -> dict:
  """`analysis.speed.run` of jaxtrain against one baseline, rounds alternating, remat none on both sides."""
  from jaxtrain.analysis import speed as bench
  # the baselines keep every activation: so does jaxtrain here; and it computes what the baseline computes
  cfg = load_config(tiny, ["model.remat=none", *SAME_MATH.get(name, [])])
  bench.check_baseline(cfg, name)
  s = shape(tiny)
  rep = bench.run(cfg, one_device_mesh(device), s["config"], steps=s["steps"], warmup=s["warmup"], baselines=[name],
                  rounds=s["rounds"], measure=False, batches=synthetic_batches(cfg, min(s["steps"], 4)))
  out = {k: rep[k] for k in ("config", "batch_size", "seq_len", "compute_dtype", "batch", "steps", "rounds",
                             "flops_per_step", "peak_flops_per_device")}
  return {**out, "remat": "none", "jaxtrain": rep["jaxtrain"], "baseline": rep["baseline_results"][name],
          "ratio": rep["ratios"][name]}


def run_child(kind: str, name: str, out: Path, *, tiny: bool, env: dict | None = None) -> dict:
  """Runs `kind name` in a child process (its own session, killed with anything it started
  when it passes its time limit); returns its figures. Raises RuntimeError with the reason."""
  cmd = [sys.executable, "-m", "tests.gpu.checks", kind, name, "--out", str(out), *(["--tiny"] if tiny else [])]
  full_env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **(env or {})}
  full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
  limit = TIMEOUT_S.get(f"{kind}:{name}", TIMEOUT_S["step"])
  proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    log, _ = proc.communicate(timeout=limit)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    raise RuntimeError(f"{kind} {name}: timed out after {limit} s") from None
  if proc.returncode != 0:
    tail = [line for line in log.splitlines() if line.strip()][-20:]
    raise RuntimeError(f"{kind} {name}: the child exited {proc.returncode}:\n" + "\n".join(tail))
  return json.loads(out.read_text())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m tests.gpu.checks")
  p.add_argument("kind", choices=("step", "baseline"))
  p.add_argument("name", help="the remat policy (step) or the baseline (baseline)")
  p.add_argument("--out", required=True)
  p.add_argument("--tiny", action="store_true")
  args = p.parse_args(argv)
  import jax
  device = jax.devices()[0]
  res = (measure_step if args.kind == "step" else measure_baseline)(args.tiny, device, args.name)
  Path(args.out).write_text(json.dumps(res, allow_nan=True))
  return 0


if __name__ == "__main__":
  sys.exit(main())
