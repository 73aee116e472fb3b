"""Eight simulated CPU devices for in-process multi-device tests (set before JAX starts)."""

import os
import sys

# The suite runs on the CPU backend even where a CUDA plugin is installed (the gpu-aot
# extra in CI): no CUDA backend is started, here or in the subprocesses that inherit this.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest

jax.config.update("jax_num_cpu_devices", 8)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def run_cli(tmp_path):
  """Runs `python -m <module> args...` in a subprocess; returns the CompletedProcess."""
  import subprocess

  from tests.helpers import clean_env  # here, not at the top: jax must see the settings above first

  def run(module, *args, env=None, timeout=300):
    full_env = clean_env(**(env or {}))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
  return run
