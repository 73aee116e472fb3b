"""`python -m jaxtrain.bench`: every field on CPU at tiny shapes, the timer, the peak, bad input."""

import json
import time

import jax
import numpy as np
import pytest

from jaxtrain import bench
from jaxtrain.analysis import speed
from jaxtrain.model import flops
from jaxtrain.parallel import devices

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

TINY = ["--set", "train.batch_size=4", "--set", "train.seq_len=64"]
STATS = {"median", "min", "max", "p25", "p75", "n"}
SIDE = {"compile_s", "step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "mfu_vs_measured_peak",
        "peak_memory_bytes", "memory_note", "devices"}


def test_bench_with_minimal_baseline_and_measured_peak_emits_every_field(run_cli, tmp_path):
  r = run_cli("jaxtrain.bench", "--mesh", "fsdp=1", "--steps", "3", "--warmup", "1", "--rounds", "2",
              "--baseline", "minimal", "--measure-peak", "--out", "b.json", *TINY)
  assert r.returncode == 0, r.stderr[-2000:]
  rep = json.loads((tmp_path / "b.json").read_text())
  assert rep["platform"] == "cpu" and rep["baselines"] == ["minimal"] and rep["batch"] == "packed"
  for side in (rep["jaxtrain"], rep["baseline_results"]["minimal"]):
    assert set(side) == SIDE
    for k in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu_vs_measured_peak"):
      assert set(side[k]) == STATS and side[k]["n"] == 6 and side[k]["median"] > 0, k
    assert side["mfu"] is None and side["peak_memory_bytes"] is None  # CPU: no peak in the table, no memory stats
    assert side["compile_s"] > 0
  from jaxtrain.core import config
  m = config.load("tiny").model
  assert rep["flops_per_token"] == flops.flops_per_token(m, 64)  # inspect's formula
  j = rep["jaxtrain"]
  # Independent check of the derived rates: the fastest step has the highest rate.
  assert j["tflops_per_device"]["max"] == pytest.approx(rep["flops_per_step"] / j["step_time_s"]["min"] / 1e12, rel=1e-6)
  v = rep["valid_tokens_per_step"]
  assert v["min"] / j["step_time_s"]["max"] <= j["tokens_per_s"]["min"] * (1 + 1e-9)
  assert j["tokens_per_s"]["max"] <= v["max"] / j["step_time_s"]["min"] * (1 + 1e-9)
  assert rep["measured_peak"]["tflops"] > 0 and rep["measured_peak"]["size"] == 1024
  assert j["mfu_vs_measured_peak"]["max"] == pytest.approx(
      j["tflops_per_device"]["max"] / rep["measured_peak"]["tflops"], rel=1e-6)
  q = rep["ratios"]["minimal"]
  assert len(q["per_round"]) == 2 and q["median"] > 0 and set(STATS) <= set(q)
  assert 0 < rep["valid_tokens_per_step"]["median"] <= 4 * 64
  # The table comes last and names both sides and the ratio.
  tail = r.stdout.strip().splitlines()
  assert tail[-1].startswith("ratio jaxtrain/minimal tokens/s:") and any(l.startswith("minimal ") for l in tail)


def test_bench_on_a_sharded_mesh_reports_per_device_rates(run_cli, tmp_path):
  r = run_cli("jaxtrain.bench", "--mesh", "dp=2", "--steps", "2", "--warmup", "1", "--out", "b.json", *TINY,
              "--set", "run.xla_flags=gpu-default")
  assert r.returncode == 0, r.stderr[-2000:]
  rep = json.loads((tmp_path / "b.json").read_text())
  # The bench times the trainer's program: the config's XLA flags were in force (they were ignored once).
  from jaxtrain.parallel import xla_flags
  assert set(xla_flags.PRESETS["gpu-default"]) <= set(rep["xla_flags"].split())
  assert rep["devices"] == 2 and rep["baselines"] == [] and rep["ratios"] == {} and rep["measured_peak"] is None
  j = rep["jaxtrain"]
  assert j["devices"] == 2 and j["step_time_s"]["n"] == 2 and j["mfu_vs_measured_peak"] is None
  assert j["tflops_per_device"]["min"] == pytest.approx(rep["flops_per_step"] / j["step_time_s"]["max"] / 2e12, rel=1e-6)


def test_pipelined_timer_attributes_each_step_its_own_time():
  # A fake asynchronous device: step i takes durations[i] after the previous one ends.
  durations = [0.03, 0.06, 0.02, 0.05]
  ends, state = [], {"free_at": 0.0}

  def run():
    start = max(time.perf_counter(), state["free_at"])
    state["free_at"] = start + durations[len(ends)]
    ends.append(state["free_at"])
    return len(ends) - 1

  def sync(i):
    while time.perf_counter() < ends[i]:
      time.sleep(0.001)
  times = speed.time_steps(run, sync, len(durations))
  np.testing.assert_allclose(times, durations, atol=0.01)
  sync_times = speed.time_steps(lambda: time.sleep(0.02), lambda _: None, 3, pipelined=False)
  np.testing.assert_allclose(sync_times, [0.02] * 3, atol=0.01)


def test_measure_peak_counts_2mnk_flops_per_product_it_waits_for(monkeypatch):
  # A hand count: each wait's products (observed here, with their shapes) cost 2*M*N*K FLOPs
  # over the time the timer's clock shows; the clock is a fake that moves 0.25 s per reading.
  from types import SimpleNamespace
  clock = iter(np.arange(1000) * 0.25)
  monkeypatch.setattr(speed, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
  waits, real_wait = [], jax.block_until_ready

  def wait(x):
    waits.append([o.shape for o in x])
    return real_wait(x)
  monkeypatch.setattr(jax, "block_until_ready", wait)
  m = speed.measure_peak(jax.devices()[0], size=64, reps=3)
  assert len(waits) == 3 and all(shapes and all(s == (64, 64) for s in shapes) for shapes in waits)
  M = N = K = 64
  assert m["flops"] == max(len(shapes) * 2 * M * N * K / 0.25 for shapes in waits)
  assert m["size"] == 64 and m["dtype"] == "bfloat16"


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA B200", 2250e12), ("cpu", None)])
def test_peak_table_by_device_kind(kind, peak):
  assert devices.peak_flops(kind) == peak


@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], ["--steps 0", ">= 1"]),
    (["--rounds", "0", "--baseline", "minimal"], ["--rounds 0"]),
    (["--warmup", "-1"], ["--warmup -1"]),
    (["--baseline", "jax"], ["--baseline 'jax'", "minimal, torch"]),
    (["--baseline", "minimal,minimal"], ["--baseline 'minimal,minimal'"]),
    (["--baseline", "minimal", "--mesh", "dp=2"], ["runs on one device", "has 2"]),
    (["--baseline", "minimal", "--set", "train.microbatches=2"], ["train.microbatches=2"]),
    (["--baseline", "torch", "--set", "model.dtype=float16"], ["model.dtype=float16", "bfloat16 or float32"]),
    (["--set", "train.seq=4"], ["unknown config key 'train.seq'"]),
    (["--out", "/nonexistent/dir/b.json"], ["--out /nonexistent/dir/b.json", "does not exist"]),
])
def test_bad_input_gives_one_line(capsys, args, words):
  with pytest.raises(SystemExit) as e:
    bench.main(["--mesh", "fsdp=1", *args])
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxtrain.bench: error:"), lines
  for w in words:
    assert w in lines[0]
