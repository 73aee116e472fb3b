"""The structure the trainer rests on: keys that declare what they change, one execution plan,
presets found from a wheel, logical axis names that must exist."""

import dataclasses
import json
import os
import subprocess
import sys
import typing

import jax
import jax.numpy as jnp
import pytest

from jaxtrain.run import checkpoint
from jaxtrain.core import config
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.parallel import sharding
from jaxtrain.run import step
from jaxtrain.core.errors import UserError
from tests.conftest import REPO
from tests.helpers import mesh_of


def _other_value(field, tp, value):
  """A different value of the same type, for the key-walking test."""
  if typing.get_origin(tp) is typing.Literal:
    return next(c for c in typing.get_args(tp) if c != value)
  if tp is bool:
    return not value
  if tp is int:
    return value + 1
  if tp is float:
    hi = field.metadata["max"]
    return (value + hi) / 2 if hi is not None else value + 1.0
  return value + "-other"


def test_every_key_declares_what_it_changes_and_the_fingerprint_follows():
  base = config.Config()
  fp = checkpoint.fingerprint(base, "tok", "data")
  for dotted, field in config.all_keys().items():
    section, name = dotted.split(".")
    assert isinstance(field.metadata["math"], bool) and field.metadata["doc"], dotted
    tp = typing.get_type_hints(config.SECTIONS[section])[name]
    other = _other_value(field, tp, getattr(getattr(base, section), name))
    changed = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **{name: other})})
    found = checkpoint.mismatches(fp, checkpoint.fingerprint(changed, "tok", "data"))
    if field.metadata["math"] and not field.metadata["content"]:
      assert list(found) == [config.category(dotted)] and dotted in found[config.category(dotted)], dotted
    else:  # run-only keys, and content keys whose files did not change
      assert found == {}, dotted


def test_resume_checks_point_the_right_way():
  saved = checkpoint.fingerprint(config.load("tiny"), "tok", "data")

  def diff(*sets):
    return checkpoint.mismatches(saved, checkpoint.fingerprint(config.load("tiny", list(sets)), "tok", "data"))
  assert diff("train.eval_interval=100", "train.microbatches=2", "run.log_every=5", "model.remat=full") == {}
  assert "data.eval_fraction: 0.0 -> 0.3" in diff("data.eval_fraction=0.3")["data"]
  assert "data.weights: '' -> '1'" in diff("data.weights=1")["data"]
  assert "optim.lr: 0.003 -> 0.1" in diff("train.lr=0.1")["train"]  # an old key name still works
  # A changed source names what changed, not only digests.
  new = checkpoint.fingerprint(config.load("tiny", ["data.source=/x/y"]), "tok", "other")
  assert checkpoint.mismatches(saved, new)["data"] == "data.source: 'bundled' (content data) -> '/x/y' (content other)"


def test_fingerprints_of_older_checkpoints_still_compare():
  """Written before keys declared their role: bare names, run keys mixed in, bare digests."""
  cfg = config.load("tiny")
  old = {"model": {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in ("attention", "remat")},
         "train": {**{k: v for k, v in dataclasses.asdict(cfg.train).items()}, "lr": 0.003, "warmup_steps": 5,
                   "eval_interval": 7},
         "tokenizer": "tok", "data": "data"}
  assert checkpoint.mismatches(old, checkpoint.fingerprint(cfg, "tok", "data")) == {}
  assert set(checkpoint.mismatches(old, checkpoint.fingerprint(cfg, "tok2", "data"))) == {"tokenizer"}


def test_renamed_keys_load_from_old_preset_files(tmp_path, capsys):
  p = tmp_path / "old.toml"
  p.write_text("[train]\nlr = 1e-4\nlog_every = 3\nsteps = 5\n")
  cfg = config.load(str(p))
  assert (cfg.optim.lr, cfg.run.log_every, cfg.train.steps) == (1e-4, 3, 5)
  assert "train.lr -> optim.lr" in capsys.readouterr().err


@pytest.mark.parametrize("setting, words", [
    ("optim.lr=nan", "optim.lr=nan is not a finite number"),
    ("optim.b2=1.0", "optim.b2=1.0 must be less than 1.0"),
    ("optim.eps=0", "optim.eps=0.0 must be greater than 0.0"),
])
def test_float_keys_have_bounds(setting, words):
  with pytest.raises(UserError, match=words.replace(".", r"\.")):
    config.load("tiny", [setting])


def test_a_typo_in_a_logical_axis_is_an_error():
  mesh = mesh_of("dp=2")
  with pytest.raises(KeyError, match="'bacth'"):
    sharding.spec_for(("bacth", "length"), (4, 8), mesh)


def test_the_plan_decides_the_kernel_once_and_it_is_what_runs(monkeypatch):
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", "model.n_layers=1"])
  called = []
  real = plan_lib.KERNELS["xla"]  # the spies compute the reference (cuDNN cannot run on CPU)
  for name in ("xla", "cudnn"):
    monkeypatch.setitem(plan_lib.KERNELS, name, lambda *a, name=name, **kw: called.append(name) or real(*a, **kw))
  for spec, forced, want in [("dp=2", None, "xla"), ("dp=2", "cudnn", "cudnn"), ("sp=2", None, "ring")]:
    mesh = mesh_of(spec)
    plan = plan_lib.build(cfg, mesh)
    if forced:  # what an H100 target would decide
      plan = dataclasses.replace(plan, attention=forced)
    setup = step.Setup(cfg, mesh, plan)
    called.clear()
    batch = {k: jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=setup.batch_sharding)
             for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
    hlo = setup.step.lower(jax.eval_shape(setup.init), batch).as_text()
    assert plan.describe().startswith(f"attention: {want} ")
    assert ("collective_permute" in hlo) == (want == "ring") and set(called) == ({want} - {"ring"}), spec


def test_the_plan_never_names_cudnn_where_the_ring_runs():
  cfg = config.load("tiny", ["model.attention=cudnn"])
  with pytest.raises(UserError, match="model.attention=cudnn cannot run with sequence=2"):
    plan_lib.build(cfg, mesh_of("sp=2"))
  # For an H100 target (compiled ahead of time on this machine) the plan picks cuDNN.
  h100 = type("Device", (), {"platform": "gpu", "compute_capability": "9.0", "device_kind": "NVIDIA H100"})()
  assert plan_lib.build(config.load("tiny"), mesh_of("dp=2"), device=h100).attention == "cudnn"


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
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["PYTHONPATH"] = str(target)  # ahead of the editable checkout
  probe = ("import jaxtrain, json; from jaxtrain import config, mesh; "
           "print(json.dumps([jaxtrain.__file__, config.preset_names(), mesh.preset_names()]))")
  r = subprocess.run([sys.executable, "-c", probe], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
  where, configs, meshes = json.loads(r.stdout)
  assert where.startswith(str(target)) and "tiny" in configs and "headline" in meshes
  r = subprocess.run([sys.executable, "-m", "jaxtrain.train", "--mesh", "dp=2", "--steps", "2"], cwd=empty, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert (empty / "runs" / "tiny" / "metrics.jsonl").read_text().count("\n") == 2
