"""No mistake destroys data already on disk (issue 38): an output path that is, or lies in, a run's files, a
prepared dataset, a Hugging Face model or the command's own input is one line, exit 2, nothing written; an export
rerun replaces only what the earlier export wrote; a refused resume rewrites nothing; a full disk during a
checkpoint save or an export is one line naming ENOSPC and leaves no half-written files."""

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxtrain import bench, hf as hf_command, train
from jaxtrain.data import __main__ as data_command
from jaxtrain.run import checkpoint, runs
from tests.helpers import clean_env, mesh_of

pytestmark = pytest.mark.slow  # one tiny run (a minute of compiling) shared by the module


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """run/ (tiny, 2 steps: checkpoints, metrics, config, lock), data/ (a prepared dataset), corpus/ (its input),
  hfdir/ (a Hugging Face model directory)."""
  d = tmp_path_factory.mktemp("world")
  r = subprocess.run([sys.executable, "-m", "jaxtrain.train", "--config", "tiny", "--steps", "2", "--workdir",
                      str(d / "run"), "--set", "checkpoint.interval=1", "--set", "run.tensorboard=false"],
                     env=clean_env(), capture_output=True, text=True, timeout=600, cwd=d)
  assert r.returncode == 0, r.stderr[-3000:]
  (d / "corpus").mkdir()
  (d / "corpus" / "a.txt").write_text("".join(f"document {i} about nothing much.\n\n" for i in range(200)))
  assert data_command.main(["prepare", "--input", str(d / "corpus" / "a.txt"), "--output", str(d / "data"),
                            "--workers", "1", "--no-progress"]) == 0
  from safetensors.numpy import save_file
  (d / "hfdir").mkdir()
  (d / "hfdir" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
  save_file({"model.norm.weight": np.ones(8, np.float32)}, str(d / "hfdir" / "model.safetensors"))
  return d


def snapshot(root) -> dict:
  """{relative path: sha256 (files) or None (directories)} of everything under `root`."""
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
          for p in sorted(root.rglob("*"))}


# (command main, argv with {w} for the world directory, words of the one line); paths relative to `world` where
# they start without {w} (the test runs from there).
DESTROYING = {
    # the cases
    "bench-out-metrics": (bench.main, ["--out", "{w}/run/metrics.jsonl"], ["metrics.jsonl", "run's files"]),
    "prepare-output-checkpoint": (data_command.main, ["prepare", "--input", "{w}/corpus/a.txt", "--output",
                                                      "{w}/run/checkpoints/2"], ["checkpoints"]),
    "export-out-checkpoint": (hf_command.main, ["export", "--workdir", "{w}/run", "--out", "{w}/run/checkpoints/2"],
                              ["checkpoints"]),
    "export-out-workdir": (hf_command.main, ["export", "--workdir", "{w}/run", "--out", "{w}/run"],
                           ["is a run directory"]),
    # more of each kind
    "bench-out-config": (bench.main, ["--out", "{w}/run/config.json"], ["config.json"]),
    "bench-out-lock": (bench.main, ["--out", "{w}/run/jaxtrain.run.lock"], ["jaxtrain.run.lock"]),
    "bench-out-relative": (bench.main, ["--out", "run/metrics.jsonl"], ["metrics.jsonl"]),
    "bench-out-dotdot": (bench.main, ["--out", "data/../run/metrics.jsonl"], ["metrics.jsonl"]),
    "bench-out-symlink": (bench.main, ["--out", "{w}/link.jsonl"], ["metrics.jsonl"]),
    "bench-out-dataset-manifest": (bench.main, ["--out", "{w}/data/manifest.json"], ["prepared dataset"]),
    "bench-out-hf-config": (bench.main, ["--out", "{w}/hfdir/config.json"], ["Hugging Face model"]),
    "bench-workdir-dataset": (bench.main, ["--workdir", "{w}/data"], ["prepared dataset"]),
    "prepare-output-own-input-dir": (data_command.main, ["prepare", "--input", "{w}/corpus/a.txt", "--output",
                                                         "{w}/corpus"], ["which this command reads"]),
    "prepare-output-is-input": (data_command.main, ["prepare", "--input", "{w}/corpus/a.txt", "--output",
                                                    "{w}/corpus/a.txt"], ["which this command reads"]),
    "prepare-output-trailing-slash": (data_command.main, ["prepare", "--input", "corpus/a.txt", "--output",
                                                          "run/checkpoints/"], ["checkpoints"]),
    "prepare-output-workdir": (data_command.main, ["prepare", "--input", "{w}/corpus/a.txt", "--output",
                                                   "{w}/run"], ["is a run directory"]),
    "prepare-output-inside-dataset": (data_command.main, ["prepare", "--input", "{w}/corpus/a.txt", "--output",
                                                          "{w}/data/more"], ["prepared dataset"]),
    "export-out-dataset": (hf_command.main, ["export", "--workdir", "{w}/run", "--out", "{w}/data"],
                           ["prepared dataset"]),
    "export-out-foreign-hf": (hf_command.main, ["export", "--workdir", "{w}/run", "--out", "{w}/hfdir"],
                              ["Hugging Face model"]),
    "export-out-workdir-dotdot": (hf_command.main, ["export", "--workdir", "run", "--out", "run/checkpoints/.."],
                                  ["is a run directory"]),
    "export-out-metrics": (hf_command.main, ["export", "--workdir", "{w}/run", "--out", "{w}/run/metrics.jsonl"],
                           ["metrics.jsonl"]),
    "import-workdir-is-source": (hf_command.main, ["import", "{w}/hfdir", "--workdir", "{w}/hfdir"],
                                 ["Hugging Face model"]),
    "import-workdir-holds-source": (hf_command.main, ["import", "{w}/hfdir", "--workdir", "{w}"],
                                    ["which this command reads"]),
    "import-workdir-in-checkpoints": (hf_command.main, ["import", "{w}/hfdir", "--workdir", "{w}/run/checkpoints/x"],
                                      ["checkpoints"]),
    "train-workdir-checkpoints": (train.main, ["--workdir", "{w}/run/checkpoints"], ["checkpoints"]),
    "train-workdir-dataset": (train.main, ["--workdir", "{w}/data"], ["prepared dataset"]),
    "train-workdir-hf-model": (train.main, ["--workdir", "hfdir"], ["Hugging Face model"]),
}


@pytest.mark.parametrize("case", DESTROYING)
def test_an_output_that_would_destroy_data_is_one_line_and_writes_nothing(case, world, monkeypatch, capsys):
  main, argv, words = DESTROYING[case]
  monkeypatch.chdir(world)
  link = world / "link.jsonl"
  if not link.is_symlink():
    link.symlink_to(world / "run" / "metrics.jsonl")
  before = snapshot(world)
  with pytest.raises(SystemExit) as e:
    main([a.replace("{w}", str(world)) for a in argv])
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
  assert all(w in lines[0] for w in words), lines[0]
  assert snapshot(world) == before  # every file byte for byte, nothing added


def _export(world, out, max_bytes):
  step_dir = runs.locate(world / "run", None)
  from jaxtrain.interop import hf_export
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of("fsdp=1"), step_dir, out, "float32",
                max_bytes, world / "run")


def _complete(out) -> set:
  """The files of `out`, checked: the index names only files that exist, and every shard is in it."""
  index = json.loads((out / "model.safetensors.index.json").read_text())
  shards = set(index["weight_map"].values())
  assert shards == {p.name for p in out.glob("model-*-of-*.safetensors")}, sorted(os.listdir(out))
  return {p.name for p in out.iterdir()}


@pytest.mark.parametrize("second", ["rerun", "killed-rerun"])
def test_an_export_rerun_replaces_only_what_the_earlier_export_wrote(second, world, tmp_path, monkeypatch):
  """8-ish shards, then (a killed) export with one file, then a rerun: no shard of an earlier export remains
  beside the new ones; a file of the user's in the directory is kept."""
  import safetensors.numpy
  out = tmp_path / "out"
  _export(world, out, 120_000)
  many = _complete(out)
  assert len([n for n in many if n.startswith("model-")]) >= 4
  (out / "README.md").write_text("mine")
  if second == "killed-rerun":
    real, calls = safetensors.numpy.save_file, []

    def killed(*a, **k):
      calls.append(1)
      real(*a, **k)
      raise KeyboardInterrupt  # the process dies after its first new file

    monkeypatch.setattr(safetensors.numpy, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
      _export(world, out, 10**9)
    monkeypatch.undo()
  _export(world, out, 10**9)
  names = _complete(out)
  assert names == {"model-00001-of-00001.safetensors", "model.safetensors.index.json", "config.json",
                   "jaxtrain_export.json", "README.md"}, names
  assert (out / "README.md").read_text() == "mine"
  # and an export is not written over by anything but an export
  with pytest.raises(SystemExit) as e:
    data_command.main(["prepare", "--input", str(world / "corpus" / "a.txt"), "--output", str(out)])
  assert e.value.code == 2


def test_metrics_file_deleted_or_moved_mid_run_is_recreated_and_said(tmp_path, capsys):
  from jaxtrain.run import runfiles
  for how in ("deleted", "moved"):
    path = tmp_path / f"{how}.jsonl"
    w = runfiles.JsonlWriter(path)
    w.write(1, {"step": 1, "loss": 1.0})
    w.write(2, {"step": 2, "loss": 0.5})
    path.unlink() if how == "deleted" else path.rename(tmp_path / "elsewhere.jsonl")
    w.write(3, {"step": 3, "loss": 0.25})
    w.write(4, {"step": 4, "loss": 0.125})
    w.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "recreated" in err[0], err
    assert w.failure is None


REFUSED = {
    # --allow-mismatch model onto other shapes: the parameter and both shapes, before config.json is rewritten
    "other-shapes": (["--set", "model.d_model=64", "--allow-mismatch", "model"], ["embed", "[512, 128]", "[512, 64]"]),
    "other-layers": (["--set", "model.n_layers=3", "--allow-mismatch", "model"], ["does not fit this model"]),
    "other-run": (["--set", "model.rope_theta=500000"], ["different run", "--allow-mismatch model"]),
    # other shapes without --allow-mismatch: the shapes' line, not a hint that the shapes then refuse
    "other-shapes-unasked": (["--set", "model.d_model=64"], ["does not fit this model", "--fresh"]),
    "no-such-step": (["--resume-from", "7"], ["--resume-from 7", "committed steps"]),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_resume_rewrites_nothing(case, world, tmp_path, capsys):
  w = tmp_path / "run"
  shutil.copytree(world / "run", w)
  before = snapshot(w)
  argv, words = REFUSED[case]
  with pytest.raises(SystemExit) as e:
    train.main(["--config", "tiny", "--workdir", str(w), "--steps", "3",
                "--set", "checkpoint.interval=1", "--set", "run.tensorboard=false", *argv])
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
  assert all(x in lines[0] for x in words), lines[0]
  assert snapshot(w) == before


def _prefs(d):
  """A prepared preference dataset (byte tokenizer) in `d`/prefs."""
  rows = [{"prompt": f"Question {i}: ", "chosen": f"a kind answer {i}.", "rejected": f"no {i}"} for i in range(64)]
  (d / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert data_command.main(["prepare", "--input", str(d / "prefs.jsonl"), "--tokenizer", "byte", "--prompt-field",
                            "prompt", "--chosen-field", "chosen", "--rejected-field", "rejected", "--output",
                            str(d / "prefs"), "--workers", "1", "--no-progress"]) == 0
  return d / "prefs"


HINTED = {  # a change of the run in the set-up's workdir -> what its refusal must say
    "same-shapes": (["--set", "model.rope_theta=500000"], "--allow-mismatch model"),
    "other-shapes": (["--set", "model.d_model=64"], "--fresh"),
    "data-and-lr": (["--set", "optim.lr=1e-3", "--set", "data.source={data}"], "--allow-mismatch train,data"),
    "lm-to-dpo": (["--set", "train.objective=dpo", "--set", "data.source={prefs}"], "--fresh"),
}


@pytest.mark.slow  # trains after the refusal
@pytest.mark.parametrize("case", HINTED)
def test_a_refusals_hint_is_accepted(case, world, tmp_path, capsys):
  """The flags a refused resume names are flags the same command then runs with: DPO onto an lm run's workdir
  named --allow-mismatch train,data, which the objective check then refused (docs/training.md's DPO command after
  the set-up); other shapes named --allow-mismatch model, which the shape check then refused."""
  w = tmp_path / "run"
  shutil.copytree(world / "run", w)
  prefs = _prefs(tmp_path) if case == "lm-to-dpo" else None
  argv = [a.format(data=world / "data", prefs=prefs) for a in HINTED[case][0]]
  base = ["--config", "tiny", "--workdir", str(w), "--steps", "3", "--set", "run.tensorboard=false", *argv]
  with pytest.raises(SystemExit) as e:
    train.main(base)
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert e.value.code == 2 and HINTED[case][1] in line, line
  hint = re.search(r"pass (--allow-mismatch \S+) ", line)
  assert train.main([*base, *(hint.group(1).split() if hint else ["--fresh"])]) == 0


def _enospc(*a, **k):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(test)")


@pytest.mark.parametrize("where", ["orbax-metadata", "orbax-metadata-while-handling-enoent", "manifest"])
def test_disk_full_during_a_checkpoint_save(where, tmp_path, monkeypatch):
  """The real async save (orbax's background threads): one line naming ENOSPC and the last good checkpoint, that
  checkpoint kept, no temporary or uncommitted directory left."""
  import jax.numpy as jnp
  from orbax.checkpoint._src.path import async_path
  from jaxtrain.core import files
  state = {"w": jnp.ones((64, 64)), "b": jnp.zeros(8)}
  ck = checkpoint.Checkpoints(tmp_path / "checkpoints", 3, 0, async_save=True)
  ck.save(1, state, {"x": 1})
  ck.wait()

  async def full(path, text):  # orbax's _METADATA write, in its background thread
    if where == "orbax-metadata":
      _enospc()
    try:
      os.stat(tmp_path / "gone")
    except FileNotFoundError:  # the context is ENOENT; the cause is the full disk
      _enospc()

  if where == "manifest":
    monkeypatch.setattr(files, "write_json_atomic", _enospc)
  else:
    monkeypatch.setattr(async_path, "write_text", full)
  try:
    ck.save(2, state, {"x": 2})
    with pytest.raises(checkpoint.CheckpointError) as e:
      ck.wait()
  finally:
    monkeypatch.undo()
    ck.close()
  text = str(e.value)
  assert "\n" not in text and "step 2 failed: No space left on device (ENOSPC)" in text, text
  assert "the last good checkpoint is 1" in text
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
  assert checkpoint.committed_steps(tmp_path / "checkpoints") == [1]


def test_disk_full_during_an_export_is_one_line_and_leaves_nothing(world, tmp_path, monkeypatch, capsys):
  import safetensors.numpy
  calls = []

  def fills(tensors, path, metadata=None):
    calls.append(path)
    with open(path, "wb") as f:  # a torn file, then the disk is full
      f.write(b"\0" * 100)
    _enospc()

  monkeypatch.setattr(safetensors.numpy, "save_file", fills)
  before = snapshot(world / "run")
  with pytest.raises(SystemExit) as e:
    hf_command.main(["export", "--workdir", str(world / "run"), "--out", str(tmp_path / "out")])
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
  assert "No space left on device (ENOSPC)" in lines[0] and "untouched" in lines[0], lines[0]
  assert len(calls) == 1 and not (tmp_path / "out").exists()  # the torn file, and the directory it made, removed
  assert snapshot(world / "run") == before
