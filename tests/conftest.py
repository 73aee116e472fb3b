"""Eight simulated CPU devices for in-process multi-device tests (set before JAX starts).

The suite runs on the CPU backend even where a CUDA plugin is installed (the gpu-aot extra
in CI): no CUDA backend is started, here or in the subprocesses that inherit this. Only a
run that selects the GPU checks (`python -m pytest -m gpu`, tests/gpu) leaves the platform
to JAX. The choice is made in pytest_configure, after the options are parsed and before any
test module is imported (JAX reads JAX_PLATFORMS when it is imported)."""

import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def selects_gpu(markexpr: str) -> bool:
  """Whether `-m markexpr` asks for the tests marked gpu (`gpu`, `gpu and not slow`; not `not gpu`)."""
  return bool(re.search(r"(?<![\w-])gpu(?![\w-])", markexpr)) and not re.search(r"\bnot\s+gpu\b", markexpr)


def pytest_configure(config):
  gpu = selects_gpu(config.getoption("markexpr") or "")
  if gpu:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # children share the device
  else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  if not gpu:  # also where a plugin imported jax before the variable was set
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
  jax.config.update("jax_num_cpu_devices", 8)
  if not gpu:  # what the commands that run steps set up on CPU devices (jaxtrain.cli.start)
    from jaxtrain import cli
    cli.cpu_settings()


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
