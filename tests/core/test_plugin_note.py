"""A GPU plugin that cannot start (installed where its GPU is not) is one line on the terminal, not a traceback."""

import importlib.util
import io
import logging
import subprocess
import sys

import pytest

from jaxtrain import cli
from tests import helpers


def test_a_plugin_that_cannot_start_is_one_line():
  log = logging.getLogger("test_plugin_note")
  out = io.StringIO()
  handler = logging.StreamHandler(out)
  log.addHandler(handler)
  log.addFilter(cli.PluginErrorInOneLine())
  try:
    try:
      raise RuntimeError("operation cuInit(0) failed: Unknown CUDA error 303\nmore detail")
    except RuntimeError:  # as jax's xla_bridge logs a plugin's failed initialize()
      log.exception("Jax plugin configuration error: Exception when calling %s.initialize()", "jax_plugins.xla_cuda12")
    log.warning("another warning stays as it is")
  finally:
    log.removeHandler(handler)
  lines = out.getvalue().splitlines()
  assert lines == ["note: jax_plugins.xla_cuda12 could not start (RuntimeError: operation cuInit(0) failed: Unknown "
                   "CUDA error 303); JAX goes on without it", "another warning stays as it is"], lines


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda12") is None, reason="needs the gpu-aot extra")
def test_a_command_on_a_machine_without_the_gpu_says_one_line():
  """The gpu-aot extra (CI installs it) on a machine without a GPU: a command's start-up prints the note, no
  traceback, and runs on the CPU."""
  code = ("import argparse, jax; from jaxtrain import cli; "
          "cli.start(argparse.Namespace(config='tiny', set=[]), 'x', mesh=False); print(jax.devices()[0].platform)")
  env = {k: v for k, v in helpers.clean_env().items() if k != "JAX_PLATFORMS"}
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
  if r.stdout.strip() != "cpu":
    pytest.skip(f"a GPU backend started here: {r.stdout.strip()}")
  assert "Traceback" not in r.stderr, r.stderr[-2000:]
  assert [l for l in r.stderr.splitlines() if "could not start" in l][:1] == [l for l in r.stderr.splitlines() if l]
