"""The GPU checks: every test under tests/gpu is marked `gpu` and skipped unless the run
selects that marker and JAX sees a GPU.

    python -m pytest -m gpu                  # on a GPU host, from the source checkout
    python -m pytest -m gpu -s               # ... with each check's figures printed
    JAXTRAIN_GPU_REPORT=gpu.json python -m pytest -m gpu   # the figures as one JSON report

Shapes: the ~1B preset (llama3-1b, seq 2048, batch 1, one device, bf16); with
JAXTRAIN_GPU_TESTS=tiny the tiny preset, which also runs on a CPU backend (a smoke test of
the checks themselves: the cuDNN ones skip there). Nothing here imports jax at module level:
tests/conftest.py chooses the platform first.
"""

import json
import os
import time
from pathlib import Path

import pytest

from tests.conftest import selects_gpu
from tests.gpu import checks

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
  mine = [item for item in items if HERE in item.path.resolve().parents]
  for item in mine:
    item.add_marker(pytest.mark.gpu)
  if not mine:
    return
  if not selects_gpu(config.getoption("markexpr") or ""):  # the CPU suite: no backend is asked
    why = "GPU check: run with python -m pytest -m gpu"
  else:
    import jax
    platforms = {d.platform for d in jax.devices()}
    why = None if "gpu" in platforms or checks.tiny_requested() else \
        f"no GPU: jax.devices() has {', '.join(sorted(platforms))} only"
  if why:
    for item in mine:
      item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def device():
  import jax
  return jax.devices()[0]


@pytest.fixture(scope="session")
def tiny(device):
  return checks.tiny_requested() or device.platform == "cpu"


@pytest.fixture(scope="session")
def report(device, tiny, tmp_path_factory):
  """The checks' figures, check name -> result; written as JSON when the session ends."""
  import jax
  started = time.time()
  rep = {"platform": device.platform, "device_kind": device.device_kind, "jax": jax.__version__, "tiny": tiny,
         "shapes": checks.shape(tiny), "checks": {}}
  yield rep["checks"]
  if rep["checks"]:
    rep["wall_s"] = time.time() - started
    out = Path(os.environ.get("JAXTRAIN_GPU_REPORT") or tmp_path_factory.getbasetemp() / "gpu-suite.json")
    out.write_text(json.dumps(rep, indent=1, allow_nan=True))
    print(f"\ntests/gpu: wrote {out}")


@pytest.fixture(scope="session")
def child(tiny, tmp_path_factory):
  """run(kind, name, env=None) -> the figures of `python -m tests.gpu.checks kind name` (see
  checks.run_child). The children share one compilation cache, new each session: a program
  an earlier child compiled is loaded, so such a compile_s is a load time (XLA_FLAGS are part
  of the key)."""
  cache = tmp_path_factory.mktemp("jax-cache")
  n = [0]

  def run(kind, name, env=None):
    n[0] += 1
    out = tmp_path_factory.getbasetemp() / f"child-{n[0]}-{kind}-{name}.json"
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **(env or {})}
    try:
      return checks.run_child(kind, name, out, tiny=tiny, env=env)
    except RuntimeError as e:
      pytest.fail(str(e), pytrace=False)
  return run
