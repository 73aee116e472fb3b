"""The GPU checks are a pytest suite (tests/gpu, marker `gpu`): what is visible without a GPU."""

import os
import subprocess
import sys

import pytest

from jaxtrain import bench
from tests.conftest import REPO, selects_gpu


def test_bench_suite_gpu_points_to_the_pytest_suite_in_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(["--suite", "gpu", "--tiny"])
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxtrain.bench: error:"), lines
  assert "python -m pytest -m gpu tests/gpu" in lines[0]


@pytest.mark.parametrize("expr, gpu", [("gpu", True), ("gpu and not slow", True), ("(gpu)", True), ("", False),
                                       ("not gpu", False), ("slow", False), ("gpus", False), ("no-gpu", False)])
def test_the_cpu_platform_is_left_only_to_runs_that_select_gpu(expr, gpu):
  assert selects_gpu(expr) is gpu


def test_gpu_tests_are_collected_and_skipped_on_the_cpu_suite(request):
  # This session is the CPU suite (JAX_PLATFORMS=cpu): no GPU, so `-m gpu` skips every check
  # (in a subprocess pinned to the CPU, so that a GPU host does not run them here).
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
  env.pop("PYTEST_ADDOPTS", None)
  r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
  tail = r.stdout.strip().splitlines()
  assert "passed" not in tail[-1] and "failed" not in tail[-1] and "error" not in tail[-1], tail[-1]
  n = int(tail[-1].split()[0])
  assert n >= 10 and tail[-1].startswith(f"{n} skipped")  # attention 6, matmul 1, remat >= 1, flags 1, baselines 2
  reasons = [line for line in tail if line.startswith("SKIPPED")]
  assert reasons and all(line.endswith("no GPU: jax.devices() has cpu only") for line in reasons), reasons
  # And without -m gpu they are skipped before any backend is asked for its devices.
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and "run with python -m pytest -m gpu" in r.stdout, r.stdout[-3000:]
