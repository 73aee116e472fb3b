"""The built wheel: installed (not editable) into an empty directory, its presets ship
inside it and the default run works."""

import pytest
import json
import subprocess
import sys

from tests.conftest import REPO
from tests.helpers import clean_env

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


def test_a_built_wheel_runs_from_an_empty_directory(tmp_path):
  """`pip install` of the wheel (not editable): presets ship inside it and the default run works."""
  wheels, target, empty = tmp_path / "wheels", tmp_path / "site", tmp_path / "empty"
  empty.mkdir()
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
  r = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), REPO],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  (wheel,) = wheels.glob("jaxtrain-*.whl")
  r = subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  env = clean_env(PYTHONPATH=str(target))  # ahead of the editable checkout
  probe = ("import jaxtrain, json; from jaxtrain.core import config; from jaxtrain.parallel import mesh; "
           "print(json.dumps([jaxtrain.__file__, config.preset_names(), mesh.preset_names()]))")
  r = subprocess.run([sys.executable, "-c", probe], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
  where, configs, meshes = json.loads(r.stdout)
  assert where.startswith(str(target)) and "tiny" in configs and "headline" in meshes
  r = subprocess.run([sys.executable, "-m", "jaxtrain.train", "--mesh", "dp=2", "--steps", "2"], cwd=empty, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert (empty / "runs" / "tiny" / "metrics.jsonl").read_text().count("\n") == 2
