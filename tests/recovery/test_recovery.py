"""Getting out of bad states without a person: one test per failure.

Every trainer run here is a subprocess on one device with a one-layer model; the runs
share a persistent compilation cache, so only the first one compiles.
"""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.run import checkpoint
from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import runfiles
from jaxtrain.run import step
from jaxtrain.core.errors import UserError
from jaxtrain.run.lock import WorkdirLock
from tests.helpers import clean_env, mesh_of

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

SETS = ["model.n_layers=1", "train.batch_size=2", "train.seq_len=16", "checkpoint.interval=2"]
RUN = ["--mesh", "dp=1"] + [a for s in SETS for a in ("--set", s)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  return clean_env(JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jit-cache")),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                   PYTHONUNBUFFERED="1")


def train(env, workdir, *extra, faults=None, cwd=None):
  full = dict(env, **({"JAXTRAIN_FAULTS": faults} if faults else {}))
  return subprocess.run([sys.executable, "-m", "jaxtrain.train", *RUN, "--workdir", str(workdir), *extra],
                        env=full, capture_output=True, text=True, timeout=300, cwd=cwd)


def ok(r):
  assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
  return r


def one_line(r, code):
  lines = r.stderr.strip().splitlines()
  assert r.returncode == code and len(lines) == 1, (r.returncode, r.stdout[-1500:], r.stderr[-3000:])
  return lines[0]


def strict(line):
  def reject(name):
    raise ValueError(f"not strict JSON: {name}")
  return json.loads(line, parse_constant=reject)


def records(workdir):
  return {r["step"]: r for r in map(strict, (workdir / "metrics.jsonl").read_text().splitlines())}


def params(step_dir):
  cfg = config.load("tiny", SETS)
  setup = step.Setup(cfg, mesh_of("dp=1"))
  ck = checkpoint.Checkpoints(step_dir.parent, 3, 0, False, is_writer=False)
  try:
    state, _ = ck.restore(step_dir, setup.abstract_state())
  finally:
    ck.mgr.close()
  return jax.device_get(state["params"])


def same_params(a, b):
  la, lb = jax.tree.leaves(params(a)), jax.tree.leaves(params(b))
  return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def base(env, tmp_path_factory):
  """The uninterrupted reference: 4 steps, checkpoints at 2 and 4."""
  w = tmp_path_factory.mktemp("base") / "w"
  return w, ok(train(env, w, "--steps", "4"))


def copy(base, tmp_path):
  w = tmp_path / "w"
  shutil.copytree(base[0], w)
  return w


def aside(w, step, reason):
  found = sorted((w / "checkpoints.aside").glob(f"{step}.{reason}.*"))
  assert len(found) == 1, list((w / "checkpoints.aside").iterdir()) if (w / "checkpoints.aside").exists() else None
  return found[0]


def same_trajectory(a, b, steps):
  for s in steps:
    assert (a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"]), s


# 1. Rolling back.

def test_rollback_moves_later_steps_aside_and_equals_the_uninterrupted_run(env, base, tmp_path):
  w = copy(base, tmp_path)
  r = ok(train(env, w, "--steps", "4", "--resume-from", "2"))
  assert "rolling back to step 2: later checkpoint(s) 4 moved to" in r.stdout and "at step 2" in r.stdout
  old4 = aside(w, 4, "rollback")  # never deleted: it is the uninterrupted run's step 4
  assert checkpoint.committed_steps(w / "checkpoints") == [2, 4]
  got, ref = records(w), records(base[0])
  assert sorted(got) == [1, 2, 3, 4]
  same_trajectory(got, ref, [3, 4])
  assert same_params(w / "checkpoints" / "4", old4)
  assert list(w.glob("metrics.*.jsonl"))  # the records of the rolled-back steps are kept aside too


# 2. A damaged latest checkpoint.

def damage(w, step_no):
  d = w / "checkpoints" / str(step_no)
  files = json.loads((d / "manifest.json").read_text())["files"]
  name = max(files, key=lambda n: files[n]["size"])
  blob = bytearray((d / name).read_bytes())
  blob[len(blob) // 2] ^= 0xFF
  (d / name).write_bytes(blob)
  return name


def test_damaged_latest_falls_back_to_the_previous_step_exactly(env, base, tmp_path):
  w = copy(base, tmp_path)
  name = damage(w, 4)
  r = ok(train(env, w, "--steps", "4"))
  warning = r.stderr.strip().splitlines()
  assert len(warning) == 1 and "warning" in warning[0] and f"file {name}" in warning[0], r.stderr
  assert "resuming from step 2" in warning[0] and "at step 2" in r.stdout
  aside(w, 4, "damaged")
  same_trajectory(records(w), records(base[0]), [3, 4])
  assert same_params(w / "checkpoints" / "4", base[0] / "checkpoints" / "4")


def test_damaged_latest_with_on_damaged_stop_names_the_way_out(env, base, tmp_path):
  w = copy(base, tmp_path)
  damage(w, 4)
  line = one_line(train(env, w, "--steps", "4", "--set", "checkpoint.on_damaged=stop"), 1)
  assert "damaged" in line and "steps 2" in line and "--resume-from 2" in line
  assert checkpoint.committed_steps(w / "checkpoints") == [2, 4]  # stop moves nothing


# 3. A torn last line in metrics.jsonl.

def test_torn_last_metrics_record_is_dropped_other_damage_is_one_line(env, base, tmp_path):
  w = copy(base, tmp_path)
  with (w / "metrics.jsonl").open("a") as f:
    f.write('{"step": 5, "loss": 2.5')
  r = ok(train(env, w, "--steps", "5"))
  assert "dropped the torn last record" in r.stdout
  got = records(w)
  assert sorted(got) == [1, 2, 3, 4, 5] and got[5]["loss"] != 2.5
  lines = (w / "metrics.jsonl").read_text().splitlines()
  lines.insert(1, "garbage")
  (w / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  line = one_line(train(env, w, "--steps", "6"), 1)
  assert "metrics.jsonl:2: unreadable metrics record" in line


def test_torn_record_of_a_committed_step_comes_back_from_its_checkpoint(env, base, tmp_path):
  """Step 4's record torn (the file cut inside it) though checkpoint 4 is committed: the checkpoint carries the
  records it covers (3 and 4), so the resume writes step 4's back exactly as the run wrote it."""
  w = copy(base, tmp_path)
  text = (w / "metrics.jsonl").read_text()
  (w / "metrics.jsonl").write_text(text[:text.rindex('{"step": 4') + 20])
  r = ok(train(env, w, "--steps", "5"))
  assert "dropped the torn last record" in r.stdout and "(steps 4) restored from the checkpoint" in r.stdout
  got, ref = records(w), records(base[0])
  assert sorted(got) == [1, 2, 3, 4, 5]
  assert got[4] == ref[4]


# 4. A write failure of the run's own files.

def test_metrics_write_failure_saves_a_checkpoint_then_one_line(env, base, tmp_path):
  w = tmp_path / "w"
  line = one_line(train(env, w, "--steps", "6", "--set", "checkpoint.interval=0", faults="metrics_enospc_at=3"), 1)
  assert "cannot write" in line and "metrics.jsonl at step 3: No space left on device" in line
  assert "checkpoint 4 was saved first" in line
  assert checkpoint.committed_steps(w / "checkpoints") == [4]
  assert sorted(records(w)) == [1, 2]
  r = ok(train(env, w, "--steps", "6", "--set", "checkpoint.interval=0"))
  assert "at step 4" in r.stdout and "steps 3, 4) restored from the checkpoint" in r.stdout
  got, ref = records(w), records(base[0])
  assert sorted(got) == [1, 2, 3, 4, 5, 6]
  same_trajectory(got, ref, [1, 2, 3, 4])


# 5. Two trainers on one workdir.

def test_second_trainer_exits_2_and_the_first_finishes_untouched(env, base, tmp_path):
  w, release = tmp_path / "w", tmp_path / "release"
  first = subprocess.Popen([sys.executable, "-m", "jaxtrain.train", *RUN, "--workdir", str(w), "--steps", "4"],
                           env=dict(env, JAXTRAIN_FAULTS=f"hold_manifest=2:{release}"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    out = []
    for line in first.stdout:
      out.append(line)
      if "holding the manifest of step 2" in line:
        break
    else:
      raise AssertionError("".join(out))
    line = one_line(train(env, w, "--steps", "4"), 2)
    assert "in use by another trainer" in line and f"pid {first.pid}" in line and socket.gethostname() in line
  finally:
    release.touch()
    rest = first.communicate(timeout=300)[0]
  assert first.returncode == 0, "".join(out) + rest
  assert checkpoint.committed_steps(w / "checkpoints") == [2, 4]
  same_trajectory(records(w), records(base[0]), [1, 2, 3, 4])
  assert same_params(w / "checkpoints" / "4", base[0] / "checkpoints" / "4")


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (tmp_path / "jaxtrain.run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 0}))
  lock = WorkdirLock(tmp_path).acquire()
  try:
    assert f"pid {dead.pid}" in lock.note and "that process is gone" in lock.note
    assert json.loads((tmp_path / "jaxtrain.run.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(UserError, match=f"in use by another trainer .*pid {os.getpid()}"):
      WorkdirLock(tmp_path).acquire()  # a second open file description: flock says no
  finally:
    lock.release()
  assert (tmp_path / "jaxtrain.run.lock").read_text() == ""  # a clean exit leaves no holder
  WorkdirLock(tmp_path).acquire().release()


# 6. Poisoned settings.

def test_non_finite_and_out_of_range_floats_are_rejected():
  floats = [(s, f.name) for s, cls in config.SECTIONS.items() for f in dataclasses.fields(cls)
            if f.type in (float, "float")]
  assert len(floats) > 10
  for section, name in floats:
    for bad in ("nan", "inf", "-inf"):
      with pytest.raises(UserError, match="not a finite number"):
        config.load("tiny", [f"{section}.{name}={bad}"])
  for item, words in [("train.b1=1", "less than 1.0"), ("train.b2=1.5", "less than 1.0"),
                      ("train.eps=0", "greater than 0.0"), ("train.min_lr_ratio=2", "above its maximum"),
                      ("model.norm_eps=0", "greater than 0.0"), ("data.eval_fraction=1", "less than 1.0")]:
    with pytest.raises(UserError, match=words):
      config.load("tiny", [item])


def test_a_non_finite_update_counts_as_skipped():
  cfg = config.load("tiny", SETS[:3])
  poisoned = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=float("nan")))  # past validation
  setup = step.Setup(poisoned, mesh_of("dp=1"))
  it = data.batches(cfg)
  batch = setup.device_batch(next(it))
  it.close()
  state = setup.init()
  before = jax.device_get(state)
  new, m = setup.step(state, batch)
  assert np.isfinite(float(m["grad_norm"])) and bool(m["skipped"])  # finite gradients, NaN update
  after = jax.device_get(new)
  assert int(after["step"]) == 0
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after["params"]), jax.tree.leaves(before["params"])))


# 7. A failed save: one line, not hundreds.

def test_failed_save_on_a_full_disk_is_one_line(env, tmp_path):
  disk = tmp_path / "disk"
  disk.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                           capture_output=True).returncode == 0
  try:  # a checkpoint here is 2.7 MB; without mount permission, a writer that fails the same way
    r = train(env, disk / "w", "--steps", "2", faults=None if mounted else "enospc_at=2")
    line = one_line(r, 1)
    assert "checkpoint save at step 2 failed: No space left on device" in line
    assert "no checkpoint has been committed yet" in line and "None" not in line
    log = disk / "w" / "jaxtrain.log"  # the pointer appears exactly when the log could take the details
    assert ("details in" in line) == (log.exists() and log.stat().st_size > 0), line
  finally:
    subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_normal_run_is_quiet_on_stderr(base):
  assert base[1].stderr == ""  # no absl "Type handler registry ... overriding" warning


# 8. User mistakes.

@pytest.fixture
def files(tmp_path):
  (tmp_path / "a-file").write_text("x")
  (tmp_path / "fake.parquet").write_text("this is not parquet")
  (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
  return tmp_path


@pytest.mark.parametrize("module, args, words", [
    ("jaxtrain.train", ["--workdir", "a-file"], ["a-file: is a file"]),
    ("jaxtrain.train", ["--workdir", "a-file/w"], ["a-file/w: a part of that path is a file"]),
    ("jaxtrain.train", ["--workdir", "ro/w"], ["ro/w: cannot create it", "Read-only file system"]),
    ("jaxtrain.data", ["prepare", "--input", "in.jsonl", "--tokenizer", "byte", "--output", "a-file"],
     ["--output a-file", "is a file"]),
    ("jaxtrain.data", ["prepare", "--input", "fake.parquet", "--tokenizer", "byte", "--output", "out"],
     ["fake.parquet", "not a readable Parquet file"]),
])
def test_user_mistakes_are_one_line_exit_2(env, files, module, args, words):
  if "ro/w" in args:
    (files / "ro").mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(files / "ro")],
                      capture_output=True).returncode:
      pytest.skip("cannot mount a read-only filesystem here (and root may write anywhere else)")
  try:
    extra = RUN if module == "jaxtrain.train" else []
    r = subprocess.run([sys.executable, "-m", module, *extra, *args], env=env, cwd=files,
                       capture_output=True, text=True, timeout=300)
    line = one_line(r, 2)
    for w in words:
      assert w in line
  finally:
    if "ro/w" in args:
      subprocess.run(["umount", str(files / "ro")], capture_output=True)


def test_help_config_into_a_closed_pipe_is_quiet(env):
  p = subprocess.Popen([sys.executable, "-m", "jaxtrain.train", "--help-config"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  p.stdout.close()  # like `| head` that has read all it wants
  err = p.stderr.read().decode()
  p.wait(timeout=120)
  assert err == "" and p.returncode == 0, err


# 9. Silently wrong input.

def test_full_width_digits_are_not_sizes():
  for spec in ("dp=２", "dp=٣", "dp=2,tp=２"):
    with pytest.raises(UserError, match="positive integer"):
      mesh_lib.parse_full(spec)
  with pytest.raises(UserError, match="not an integer"):
    config.load("tiny", ["train.steps=２０"])


def test_metrics_are_strict_json_after_a_skipped_step(env, tmp_path):
  # lr=1e30: the first update blows the params up, and the next steps are non-finite.
  w = tmp_path / "w"
  r = train(env, w, "--steps", "20", "--set", "train.lr=1e30", "--set", "train.max_skipped_in_a_row=2")
  assert r.returncode == 1 and "aborting at step 3" in r.stderr, r.stderr[-1500:]
  got = records(w)  # strict: a bare NaN would raise
  skipped = [rec for rec in got.values() if rec["skipped"]]
  assert skipped and all(rec["grad_norm"] is None or rec["loss"] is None for rec in skipped)


def test_strict_json_writes_null_for_non_finite(tmp_path):
  out = runfiles.JsonlWriter(tmp_path / "m.jsonl")
  out.write(1, {"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "skipped": True})
  out.close()
  assert strict((tmp_path / "m.jsonl").read_text()) == {"step": 1, "loss": None, "grad_norm": None, "skipped": True}


# 10. Quiet by default, outputs under the workdir.

def test_bench_prints_progress_and_writes_under_the_workdir(env, tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxtrain.bench", "--mesh", "dp=1", "--steps", "1", "--warmup", "0",
                      *[a for s in SETS[:3] for a in ("--set", s)], "--workdir", "wb"],
                     env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-1500:]
  assert "bench: compiling the jaxtrain step" in r.stdout and "bench: timing round 1/1" in r.stdout
  assert (tmp_path / "wb" / "bench.json").is_file() and not (tmp_path / "bench.json").exists()


# 11. Mismatch messages name what changed.

def test_mismatch_names_the_changed_tokenizer_and_data_paths():
  a = config.load("tiny")
  b = config.load("tiny", ["data.tokenizer=tok/tokenizer.json", "data.source=corpus/prepared"])
  diff = checkpoint.mismatches(checkpoint.fingerprint(a, "t1", "d1"), checkpoint.fingerprint(b, "t2", "d2"))
  assert "data.tokenizer: 'byte' (content t1) -> 'tok/tokenizer.json' (content t2)" in diff["tokenizer"]
  assert "data.source: 'bundled' (content d1) -> 'corpus/prepared' (content d2)" in diff["data"]
  same = checkpoint.mismatches(checkpoint.fingerprint(a, "t1", "d1"), checkpoint.fingerprint(a, "t1", "d9"))
  assert same == {"data": "data.source: 'bundled' (content d1) -> 'bundled' (content d9)"}  # same path, new content
