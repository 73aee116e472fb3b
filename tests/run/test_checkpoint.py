"""Checkpoints and exact resume, and the failure rehearsals of DESIGN.md."""

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import typing

import jax
import numpy as np
import pytest

from jaxtrain.run import checkpoint
from jaxtrain.core import config
from jaxtrain.run import step
from tests.core.test_config import CONTENT_KEYS, MATH_KEYS, RUN_KEYS
from tests.helpers import clean_env, mesh_of

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

# Sharded, accumulating, packed: the data iterator state and the mesh both matter.
RUN = ["--mesh", "fsdp=2,tp=2", "--set", "model.dtype=float32", "--set", "train.microbatches=2"]


def _records(workdir):
  return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def _train(run_cli, workdir, *extra, env=None):
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(workdir), *extra, env=env)
  assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
  return r


def _params(step_dir, spec="fsdp=2,tp=2"):
  cfg = config.load("tiny", ["model.dtype=float32", "train.microbatches=2"])
  setup = step.Setup(cfg, mesh_of(spec))
  ck = checkpoint.Checkpoints(step_dir.parent, 3, 0, False)
  state, _ = ck.restore(step_dir, setup.abstract_state())
  ck.mgr.close()
  return jax.device_get(state["params"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """The uninterrupted reference: 8 steps in one run."""
  import subprocess as sp
  w = tmp_path_factory.mktemp("straight") / "w"
  env = clean_env()
  r = sp.run([sys.executable, "-m", "jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "8",
              "--set", "checkpoint.interval=3"], env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  return w


def _same_losses(a, b, steps):
  for s in steps:
    assert (a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"]), s


def test_exact_resume_is_bit_for_bit(run_cli, tmp_path, straight, saved):
  w = tmp_path / "w"
  shutil.copytree(saved, w)  # a finished 3-step run
  r = _train(run_cli, w, "--steps", "6")
  assert "resumed from" in r.stdout and "at step 3" in r.stdout
  got, ref = _records(w), _records(straight)
  assert sorted(got) == [1, 2, 3, 4, 5, 6]
  _same_losses(got, ref, [4, 5, 6])
  assert got[6]["tokens_seen"] == ref[6]["tokens_seen"] and got[6]["tokens_updated"] == ref[6]["tokens_updated"]
  # Final params bit for bit: step 6 of this run against step 6 of the straight run.
  a, b = _params(w / "checkpoints" / "6"), _params(straight / "checkpoints" / "6")
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_resume_onto_a_different_mesh(run_cli, tmp_path, straight):
  w = tmp_path / "w"
  r = run_cli("jaxtrain.train", "--mesh", "dp=4", *RUN[2:], "--workdir", str(w), "--steps", "3")
  assert r.returncode == 0, r.stderr[-1500:]
  r = _train(run_cli, w, "--steps", "5")
  assert "written on mesh data=4, resharded" in r.stdout
  got, ref = _records(w), _records(straight)
  for s in [4, 5]:
    np.testing.assert_allclose(got[s]["loss"], ref[s]["loss"], rtol=1e-5)
    np.testing.assert_allclose(got[s]["grad_norm"], ref[s]["grad_norm"], rtol=1e-5)


def _popen(workdir, *extra, env=None):
  full = clean_env(**{**(env or {}), "PYTHONUNBUFFERED": "1"})
  return subprocess.Popen([sys.executable, "-m", "jaxtrain.train", *RUN, "--workdir", str(workdir), *extra],
                          env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc, text, limit=200):
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if text in line:
      return lines
    assert len(lines) < limit
  raise AssertionError(f"never printed {text!r}: {''.join(lines)[-1500:]}")


def test_killed_during_async_save_resumes_from_last_committed(run_cli, tmp_path, straight):
  w = tmp_path / "w"
  proc = _popen(w, "--steps", "8", "--set", "checkpoint.interval=2", env={"JAXTRAIN_FAULTS": "hold_manifest=4:120"})
  try:
    _wait_for(proc, "holding the manifest of step 4")
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.wait(timeout=60)
  assert (w / "checkpoints" / "4").exists() and not (w / "checkpoints" / "4" / "manifest.json").exists()
  r = _train(run_cli, w, "--steps", "8", "--set", "checkpoint.interval=2")
  assert "step 4 has no manifest.json" in r.stdout and "at step 2" in r.stdout
  assert [p.name.split(".")[:2] for p in (w / "checkpoints.aside").iterdir()] == [["4", "no-manifest"]]
  _same_losses(_records(w), _records(straight), range(3, 9))


def test_sigterm_checkpoints_the_current_step_and_exits_0(run_cli, tmp_path, straight):
  w = tmp_path / "w"
  proc = _popen(w, "--steps", "500", "--set", "checkpoint.interval=0")
  try:
    _wait_for(proc, "step      2/500")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
  finally:
    proc.kill()
  assert proc.returncode == 0, out
  at = max(checkpoint.committed_steps(w / "checkpoints"))
  assert f"preempted: checkpoint committed at step {at}" in out and 2 <= at < 500
  r = _train(run_cli, w, "--steps", str(at + 2), "--set", "checkpoint.interval=0")
  assert f"at step {at}" in r.stdout
  _same_losses(_records(w), _records(straight), [s for s in range(at + 1, at + 3) if s <= 8])


def _tmpfs(path, size):
  path.mkdir()
  return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0


def test_disk_full_reports_and_keeps_the_last_good_checkpoint(run_cli, tmp_path, saved):
  # the size of one checkpoint of this RUN: the saved run's (same arrays, whatever the step)
  one = sum(p.stat().st_size for p in (saved / "checkpoints" / "3").rglob("*") if p.is_file())
  disk = tmp_path / "disk"
  env = None
  if not _tmpfs(disk, int(one * 1.6)):  # room for one checkpoint, not two
    env = {"JAXTRAIN_FAULTS": "enospc_at=4"}  # no mount permission: a writer that fails the same way
  try:
    r = run_cli("jaxtrain.train", *RUN, "--workdir", str(disk / "w"), "--steps", "6",
                "--set", "checkpoint.interval=2", env=env)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and "checkpoint save at step 4 failed" in last, r.stderr[-2000:]
    assert "No space left on device" in last and "the last good checkpoint is 2" in last
    assert checkpoint.committed_steps(disk / "w" / "checkpoints") == [2]
    params = _params(disk / "w" / "checkpoints" / "2")  # verified and restorable
    assert len(jax.tree.leaves(params)) > 0
  finally:
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)  # -l: even while a file there is open


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A finished 3-step run to resume and to tamper with (copied per test)."""
  w = tmp_path_factory.mktemp("saved") / "w"
  env = clean_env()
  r = subprocess.run([sys.executable, "-m", "jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "3"],
                     env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  return w


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_corrupt_checkpoint_is_detected_and_named(run_cli, tmp_path, saved, damage):
  w = tmp_path / "w"
  shutil.copytree(saved, w)
  manifest = json.loads((w / "checkpoints" / "3" / "manifest.json").read_text())
  name = max(manifest["files"], key=lambda n: manifest["files"][n]["size"])  # the big array file
  path = w / "checkpoints" / "3" / name
  blob = bytearray(path.read_bytes())
  if damage == "truncate":
    path.write_bytes(blob[: len(blob) // 2])
  else:
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(blob)
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "4")
  assert r.returncode == 1
  assert f"file {name}" in r.stderr and "damaged" in r.stderr


def test_changed_config_or_tokenizer_aborts_unless_allowed(run_cli, tmp_path, saved):
  w = tmp_path / "w"
  shutil.copytree(saved, w)
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "4", "--set", "model.rope_theta=500000")
  assert r.returncode == 2
  assert "model.rope_theta: 10000.0 -> 500000.0" in r.stderr and "--allow-mismatch model" in r.stderr
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "4", "--set", "train.lr=0.1")
  assert r.returncode == 2 and "optim.lr: 0.003 -> 0.1" in r.stderr
  # A checkpoint written with another tokenizer.
  mpath = w / "checkpoints" / "3" / "manifest.json"
  manifest = json.loads(mpath.read_text())
  manifest["fingerprint"]["tokenizer"] = "0123456789abcdef"
  mpath.write_text(json.dumps(manifest))
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "4")
  assert r.returncode == 2 and "data.tokenizer: content 0123456789abcdef -> 'byte' (content " in r.stderr
  r = _train(run_cli, w, "--steps", "4", "--allow-mismatch", "tokenizer")
  assert "at step 3" in r.stdout and sorted(_records(w)) == [1, 2, 3, 4]


def test_rotation_keeps_the_newest_and_every_nth(tmp_path):
  d = tmp_path / "checkpoints"
  ck = checkpoint.Checkpoints(d, keep=2, keep_every=4, async_save=False)
  for s in [2, 4, 6, 8, 10, 12]:
    (d / str(s)).mkdir()
    (d / str(s) / "manifest.json").write_text("{}")
    ck._rotate()
  assert checkpoint.committed_steps(d) == [4, 8, 10, 12]
  ck.mgr.close()


def test_fresh_moves_old_checkpoints_aside(run_cli, tmp_path, saved):
  w = tmp_path / "w"
  shutil.copytree(saved, w)
  r = _train(run_cli, w, "--steps", "1", "--fresh")
  assert "previous checkpoints moved to" in r.stdout and "resumed" not in r.stdout
  assert list(w.glob("checkpoints.*/3/manifest.json")) and checkpoint.committed_steps(w / "checkpoints") == [1]


def _files(d):
  """{path: bytes (None for a directory)} of everything under `d`."""
  return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def test_refused_and_idle_reruns_touch_nothing(run_cli, tmp_path, saved):
  """A refused resume, a run with nothing to do, and bad data in a new workdir write, move and create nothing."""
  w = tmp_path / "w"
  shutil.copytree(saved, w)
  (w / "jaxtrain.run.lock").unlink()  # as a run's files can be copied, or the lock file removed by hand
  before = _files(w)
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(w), "--set", "model.rope_theta=500000")
  assert r.returncode == 2 and "model.rope_theta: 10000.0 -> 500000.0" in r.stderr
  assert _files(w) == before  # config.json still describes the checkpoints
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(w), "--set", "train.steps=3", "--allow-mismatch", "train")
  assert r.returncode == 0 and "nothing to do: the run is at step 3 and train.steps is 3" in r.stdout
  assert _files(w) == before  # no empty TensorBoard events file, no metrics copy
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(tmp_path / "new"), "--set", f"data.source={tmp_path / 'no'}")
  assert r.returncode == 2 and "does not exist" in r.stderr and not (tmp_path / "new").exists()
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(tmp_path / "new"), "--resume-from", "2")
  assert r.returncode == 2 and "no committed checkpoint" in r.stderr and not (tmp_path / "new").exists()
  (tmp_path / "empty").mkdir()  # an existing, empty workdir stays empty (on main the lock file was left there)
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(tmp_path / "empty"), "--resume-from", "2")
  assert r.returncode == 2 and "no committed checkpoint" in r.stderr and _files(tmp_path / "empty") == {}


def test_only_saves_orbax_never_committed_are_removed(tmp_path):
  """A step orbax finalized but whose manifest.json is gone is moved aside; an orbax temporary is removed."""
  d = tmp_path / "checkpoints"
  for name in ["2", "4", "6.orbax-checkpoint-tmp-1700000000"]:
    (d / name).mkdir(parents=True)
    (d / name / "commit_success.txt").write_text("x")
  (d / "2" / "manifest.json").write_text("{}")
  checkpoint.Checkpoints(d, keep=3, keep_every=0, async_save=False).mgr.close()
  assert sorted(p.name for p in d.iterdir()) == ["2"]
  kept = list((tmp_path / "checkpoints.aside").iterdir())
  assert [p.name.split(".")[:2] for p in kept] == [["4", "no-manifest"]] and (kept[0] / "commit_success.txt").exists()


def test_moves_in_one_second_keep_everything(tmp_path, monkeypatch):
  """--fresh, rollbacks and metrics copies, twice within one second: every moved thing is kept, one scheme."""
  import time
  from jaxtrain.run import runfiles
  monkeypatch.setattr(time, "time", lambda: 1.8e9)
  monkeypatch.setattr(time, "gmtime", lambda *a: time.struct_time((2027, 1, 15, 8, 0, 0, 4, 15, 0)))
  for i in range(2):
    (tmp_path / "metrics.jsonl").write_text(f"run {i}\n")
    runfiles.prepare_metrics(tmp_path / "metrics.jsonl", None)
  assert _files(tmp_path) == {"metrics.previous.20270115T080000Z.jsonl": b"run 0\n",
                              "metrics.previous.20270115T080000Z.1.jsonl": b"run 1\n"}
  for i in range(2):
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "3" / "run").write_text(str(i))
    checkpoint.move_aside(tmp_path / "checkpoints" / "3", tmp_path / "checkpoints.aside", "rollback")
    runfiles.move_aside(tmp_path / "checkpoints", tmp_path, "fresh")
  moved = {k: v for k, v in _files(tmp_path).items() if not k.startswith("metrics.")}
  assert moved == {
      "checkpoints.aside": None, "checkpoints.aside/3.rollback.20270115T080000Z": None,
      "checkpoints.aside/3.rollback.20270115T080000Z/run": b"0", "checkpoints.aside/3.rollback.20270115T080000Z.1": None,
      "checkpoints.aside/3.rollback.20270115T080000Z.1/run": b"1",
      "checkpoints.fresh.20270115T080000Z": None, "checkpoints.fresh.20270115T080000Z.1": None}


def test_an_aborted_run_keeps_its_committed_checkpoints(run_cli, tmp_path):
  # lr=1e30 makes every step after the first non-finite; the run aborts at step 4, after
  # saving step 2 asynchronously: that save must still be committed with its manifest.
  w = tmp_path / "w"
  r = run_cli("jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "50", "--set", "train.lr=1e30",
              "--set", "train.max_skipped_in_a_row=2", "--set", "checkpoint.interval=2")
  assert r.returncode == 1 and "aborting at step 3" in r.stderr
  assert checkpoint.committed_steps(w / "checkpoints") == [2]


def test_resume_checks_point_the_right_way():
  saved = checkpoint.fingerprint(config.load("tiny"), "tok", "data")

  def diff(*sets):
    return checkpoint.mismatches(saved, checkpoint.fingerprint(config.load("tiny", list(sets)), "tok", "data"))
  assert diff("train.eval_interval=100", "train.microbatches=2", "run.log_every=5", "model.remat=full") == {}
  assert "data.eval_fraction: 0.0 -> 0.3" in diff("data.eval_fraction=0.3")["data"]
  assert diff("data.weights=1") == {}  # one source: the weights act not (config.DEPENDENT)
  two = checkpoint.fingerprint(config.load("tiny", ["data.source=a,b"]), "tok", "data")
  weighted = checkpoint.fingerprint(config.load("tiny", ["data.source=a,b", "data.weights=1,2"]), "tok", "data")
  assert "data.weights: '' -> '1,2'" in checkpoint.mismatches(two, weighted)["data"]
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


# Where a key that acts only with another acts (written by hand): the key-walking test changes it there. A key that
# acts not changes nothing and is left out (tests/core/test_dependent_keys.py).
ACTING = [
    (("model.lora_alpha", "model.lora_targets"), {"model": {"lora_rank": 4}}),
    (("model.moe_grouped_matmul",), {"model": {"moe_experts": 4, "moe_dropless": True}}),
    (("model.moe_topk_group",), {"model": {"moe_experts": 4, "moe_n_group": 2}}),
    (("model.moe_",), {"model": {"moe_experts": 4}}),
    (("model.q_lora_rank", "model.kv_lora_rank", "model.qk_nope_head_dim", "model.qk_rope_head_dim",
      "model.v_head_dim"), {"model": {"attention_type": "mla"}}),
    (("model.rope_beta", "model.rope_mscale", "model.rope_truncate"), {"model": {"rope_scaling": "yarn"}}),
    (("model.layer_types", "model.rope_local_theta"), {"model": {"sliding_window": 4}}),
    (("model.swiglu_",), {"model": {"mlp_activation": "swiglu_clamped"}}),
    (("model.rope_",), {"model": {"rope_scaling": "llama3"}}),
    (("train.dpo_beta",), {"train": {"objective": "dpo"}}),
    (("optim.lr_batch_scaling",), {"optim": {"lr_reference_batch": 4}}),
    (("loss_scale.",), {"loss_scale": {"mode": "dynamic"}}),
    (("data.eval_source", "data.eval_batches"), {"train": {"eval_interval": 1}}),
    (("data.weights",), {"data": {"source": "a,b"}}),
    (("run.xla_flags_unknown",), {"run": {"xla_flags_extra": "--xla_some_flag=1"}}),
]


def _acting(dotted: str) -> config.Config:
  """The default config, with what makes `dotted` act (ACTING) set."""
  sets = next((sets for prefixes, sets in ACTING if dotted.startswith(prefixes)), {})
  base = config.Config()
  return dataclasses.replace(base, **{s: dataclasses.replace(getattr(base, s), **kv) for s, kv in sets.items()})


def test_every_key_changes_the_fingerprint_exactly_when_it_changes_the_math():
  """Each key set to another value (where it acts): the resume check must object to exactly the math keys
  (listed by hand in tests/core/test_config.py), under the key's category; a content key
  whose files did not change, and every run key, must pass."""
  for dotted, field in config.all_keys().items():
    base = _acting(dotted)
    fp = checkpoint.fingerprint(base, "tok", "data")
    section, name = dotted.split(".")
    tp = typing.get_type_hints(config.SECTIONS[section])[name]
    other = _other_value(field, tp, getattr(getattr(base, section), name))
    changed = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **{name: other})})
    found = checkpoint.mismatches(fp, checkpoint.fingerprint(changed, "tok", "data"))
    if dotted in MATH_KEYS:
      assert list(found) == [config.category(dotted)] and dotted in found[config.category(dotted)], (dotted, found)
    else:
      assert dotted in CONTENT_KEYS | RUN_KEYS and found == {}, (dotted, found)
