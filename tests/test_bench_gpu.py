"""`python -m jaxtrain.bench --suite gpu` on the CPU at tiny shapes: the report's structure and
real figures; a failing or hung check is recorded and the others still run."""

import json
import math
import time

import pytest

from jaxtrain.analysis import bench_gpu
from jaxtrain.parallel import xla_flags

# Only to shorten XLA:CPU's compiles (the figures stay real measurements, of a less optimized build).
FAST_CPU = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# One check of each kind (torch's is covered by test_baselines, the other remat policies by
# test_model): the whole list at tiny shapes takes about a minute of CPU, over this test's budget.
CHECKS = "attention,matmul_peak,remat_none,xla_flags,baseline_minimal"
ENTRY = {"status", "reason", "result", "wall_s"}


def test_suite_on_cpu_writes_real_figures_for_every_check(run_cli, tmp_path):
  r = run_cli("jaxtrain.bench", "--suite", "gpu", "--checks", CHECKS, "--out", "s.json",
              env={"XLA_FLAGS": FAST_CPU}, timeout=600)
  assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
  rep = json.loads((tmp_path / "s.json").read_text())
  assert rep["suite"] == "gpu" and rep["platform"] == "cpu" and rep["tiny"] is True
  assert list(rep["checks"]) == CHECKS.split(",")
  for name, c in rep["checks"].items():
    assert set(c) == ENTRY and c["status"] == "ok", (name, c["reason"])
    assert c["wall_s"] > 0
  ch = {k: c["result"] for k, c in rep["checks"].items()}

  # Attention: the XLA `fused` call and the bf16 reference against the float32 reference, both
  # layouts; bf16 rounding makes the errors non-zero, and they stay within a few bf16 ulps.
  a = ch["attention"]
  for layout in ("unpacked", "packed"):
    for kernel in ("reference_bf16", "xla_fused"):
      e = a[layout][kernel]
      assert e["status"] == "ok" and set(e["rel_error"]) == {"out", "dq", "dk", "dv"}
      assert all(0 < x < 2e-2 for x in e["rel_error"].values()), (layout, kernel, e)
    d = a[layout]["xla_fused"]["max_abs_diff_vs_reference_bf16"]
    assert all(math.isfinite(x) and x >= 0 for x in d.values())
    for kernel in ("cudnn", "cudnn_packed_offsets"):
      assert a[layout][kernel] == {"status": "skipped", "reason": "no GPU"}

  m = ch["matmul_peak"]
  assert m["flops"] > 0 and m["tflops"] == pytest.approx(m["flops"] / 1e12)
  assert m["table_peak_flops"] is None and m["fraction_of_table"] is None  # the CPU is not in the table

  b = ch["baseline_minimal"]
  assert b["batch"] == "one document per row" and b["remat"] == "none"
  jt, mt = b["jaxtrain"]["step_time_s"], b["baseline"]["step_time_s"]
  assert jt["median"] > 0 and mt["median"] > 0 and jt["n"] == mt["n"] == 3
  # One round: the ratio is the two sides' median step times (minimal / jaxtrain).
  assert b["ratio"]["median"] == pytest.approx(mt["median"] / jt["median"], rel=1e-9)

  vocab = 512  # the tiny preset's
  s = ch["remat_none"]
  assert s["remat"] == "none" and s["attention"] == "xla" and s["step_time_s"]["median"] > 0
  assert s["peak_memory_bytes"] is None  # the CPU backend keeps no memory statistics
  assert s["compiled_memory_bytes"]["argument"] > 0 and s["compiled_memory_bytes"]["temp"] > 0
  assert abs(s["loss_after"] - math.log(vocab)) < 1.0  # random tokens: about ln(vocab) after 5 steps

  f = ch["xla_flags"]
  assert f["accepted"] == xla_flags.PRESETS["gpu-default"] and f["dropped"] == []
  # The run with the preset had the flags in force; the one without did not.
  assert set(f["accepted"]) <= set(f["with"]["xla_flags"].split())
  assert not set(f["accepted"]) & set(f["without"]["xla_flags"].split())
  assert "remat_none" in f["without_source"] and f["without"] == ch["remat_none"]
  assert f["step_time_ratio_with_over_without"] == pytest.approx(
      f["with"]["step_time_s"]["median"] / f["without"]["step_time_s"]["median"])

  lines = r.stdout.strip().splitlines()
  assert lines[-len(rep["checks"]):][0].startswith("attention ")
  assert all(line.split()[1] == "ok" for line in lines[-len(rep["checks"]):])


def test_a_failing_and_a_hung_check_are_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", FAST_CPU)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  limits = {"attention": 0.0}  # attention "hangs": stopped as soon as it starts
  monkeypatch.setattr(bench_gpu, "timeout_of", lambda name: limits.get(name, 120))
  runner = bench_gpu.Runner(tmp_path / "s.json", tiny=True, budget_s=300)
  t = time.monotonic()
  runner.run(["no_such_check", "attention", "matmul_peak"])
  res = runner.results
  assert res["no_such_check"]["status"] == "failed"
  assert res["no_such_check"]["reason"] == "ValueError: unknown check 'no_such_check'"
  assert res["attention"]["status"] == "failed" and res["attention"]["reason"].startswith("timed out after")
  assert res["matmul_peak"]["status"] == "ok" and res["matmul_peak"]["result"]["flops"] > 0
  assert time.monotonic() - t < 120


def test_baselines_take_scanned_parameters_layer_by_layer():
  # The suite's presets scan their layers; the baselines index layers one by one. Split, the
  # scanned parameters give the loss of the unscanned model at the same seed (float32).
  import jax
  import numpy as np
  from flax import nnx
  from jaxtrain.analysis import baselines
  from jaxtrain.core import config
  from jaxtrain.model import transformer as model
  from jaxtrain.analysis.baselines import minimal
  losses = []
  for scan in ("false", "true"):
    cfg = config.load("tiny", [f"model.scan_layers={scan}", "model.dtype=float32"])
    params = nnx.to_pure_dict(nnx.state(model.Transformer(cfg.model, nnx.Rngs(0))))
    params = baselines.layer_list(jax.device_get(params), cfg.model.n_layers)
    assert sorted(params["layers"]) == list(range(cfg.model.n_layers))
    batch = bench_gpu.synthetic_batches(config.load("tiny", ["train.batch_size=2", "train.seq_len=16"]), 1)[0]
    losses.append(float(jax.jit(lambda p, b, m=cfg.model: minimal.loss_fn(p, m, b))(params, batch)))
  np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
