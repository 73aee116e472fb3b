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


def _share_compiled_programs() -> None:
  """One persistent compilation cache for the session: the xdist workers and every subprocess (which inherit the
  environment) compile a program the first time any of them meets it and read it back afterwards. The tests build
  the same small models over and over, in-process and through the commands; a cache hit skips XLA's compile,
  which is most of a small test's time. The controller makes the folder and removes it at the end."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # a worker (or a user's own cache): use what is given
    return
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxtrain-test-cache-")
  os.environ["JAXTRAIN_TEST_CACHE_OWNER"] = str(os.getpid())
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # small programs are the whole suite
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
  if os.environ.get("JAXTRAIN_TEST_CACHE_OWNER") == str(os.getpid()):
    import shutil
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_configure(config):
  gpu = selects_gpu(config.getoption("markexpr") or "")
  _share_compiled_programs()
  if gpu:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # children share the device
  else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from tests.suite_env import SUITE_XLA_FLAGS
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *SUITE_XLA_FLAGS]).strip()
  import jax
  if not gpu:  # also where a plugin imported jax before the variable was set
    jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])  # if jax came in first
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
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
