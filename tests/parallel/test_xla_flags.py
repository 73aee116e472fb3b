"""XLA flags (jaxtrain.parallel.xla_flags): unknown flags stop the command, or with run.xla_flags_unknown=warn are
dropped with a warning; the verdicts are cached, and the gpu-default preset is known to this jaxlib."""

import subprocess
import sys

from jaxtrain.parallel import xla_flags
from tests.helpers import clean_env


def test_unknown_xla_flag_is_dropped_with_a_warning(tmp_path, capsys):
  cache = tmp_path / "flags.json"
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/user_choice"}
  added = xla_flags.apply("none", "--xla_jaxtrain_no_such_flag=1 --xla_gpu_enable_latency_hiding_scheduler=true "
                          "--xla_dump_to=/tmp/ignored", environ=env, cache=cache, unknown="warn")
  assert added == ["--xla_gpu_enable_latency_hiding_scheduler=true"]
  assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/user_choice --xla_gpu_enable_latency_hiding_scheduler=true"
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["warning: dropping XLA flag(s) this jaxlib does not know: --xla_jaxtrain_no_such_flag=1"]
  # The verdicts are cached: a second call decides without a probe.
  assert xla_flags.validate(["--xla_jaxtrain_no_such_flag=2"], cache)[1] == ["--xla_jaxtrain_no_such_flag=2"]
  # What is kept really starts XLA (the independent check: a fresh process with those flags).
  r = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                     env=clean_env(XLA_FLAGS=env["XLA_FLAGS"], JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-500:]


def test_gpu_default_preset_flags_are_known_to_this_jaxlib(tmp_path):
  kept, dropped = xla_flags.validate(xla_flags.PRESETS["gpu-default"], tmp_path / "flags.json")
  assert dropped == [] and len(kept) == len(xla_flags.PRESETS["gpu-default"])


def test_a_failed_probe_is_one_line_and_not_cached(tmp_path, capsys, monkeypatch):
  """A probe that times out or dies for another reason decides nothing: this run goes without the flags (one
  line says so) and the next run probes again and keeps the flags this jaxlib knows."""
  cache, flag = tmp_path / "flags.json", "--xla_gpu_enable_latency_hiding_scheduler=true"
  real_run = subprocess.run

  def timeout(*a, **k):
    raise subprocess.TimeoutExpired(a[0], 120)
  for broken in (timeout, lambda *a, **k: real_run([sys.executable, "-c", "raise SystemExit(3)"], **k)):
    monkeypatch.setattr(xla_flags.subprocess, "run", broken)
    env = {}
    assert xla_flags.apply("none", flag, environ=env, cache=cache) == [] and "XLA_FLAGS" not in env
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: could not check XLA flag(s) " + flag), err
    assert not cache.exists()
  monkeypatch.setattr(xla_flags.subprocess, "run", real_run)
  env = {}
  assert xla_flags.apply("none", flag, environ=env, cache=cache) == [flag] and env["XLA_FLAGS"] == flag
