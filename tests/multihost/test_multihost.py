"""Two processes x 4 simulated CPU devices on localhost (gloo) against one process x 8."""

import json
import re
import signal
import time

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.core import files
from jaxtrain.run import checkpoint
from tests.multihost import procs as multihost
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

TIMEOUT = 300
RUN = ["jaxtrain.train", "--mesh", "dp=2,fsdp=2,tp=2,dcn.dp=2", "--set", "model.dtype=float32",
       "--set", "train.microbatches=2", "--set", "checkpoint.interval=2"]


def _records(workdir):
  return {r["step"]: r for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def _two(tmp_path, name, *extra, env=None):
  cwd = tmp_path / name
  cwd.mkdir()
  codes = multihost.wait_all(multihost.launch([*RUN, "--workdir", "w", *extra], 2, cwd, env), TIMEOUT)
  assert codes == [0, 0], multihost.log_of(cwd, 0)[-2000:] + multihost.log_of(cwd, 1)[-2000:]
  return cwd / "w"


def _one(run_cli, tmp_path, name, *extra):
  w = tmp_path / name
  r = run_cli(*[a if a != "dp=2,fsdp=2,tp=2,dcn.dp=2" else "dp=2,fsdp=2,tp=2" for a in RUN], "--workdir", str(w), *extra)
  assert r.returncode == 0, r.stderr[-2000:]
  return w, r


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """4 steps on 2 processes and on 1 process of 8 devices (checkpoints at 2 and 4)."""
  import subprocess
  import sys
  tmp = tmp_path_factory.mktemp("mh")
  two = _two(tmp, "two", "--steps", "4")
  one = tmp / "one"
  r = subprocess.run([sys.executable, "-m", *[a if "dcn" not in a else "dp=2,fsdp=2,tp=2" for a in RUN],
                      "--workdir", str(one), "--steps", "4"], env=multihost.clean_env(), capture_output=True,
                     text=True, timeout=TIMEOUT)
  assert r.returncode == 0, r.stderr[-2000:]
  return two, one, r.stdout + r.stderr


def test_two_processes_match_one_process(runs):
  two, one = _records(runs[0]), _records(runs[1])
  assert sorted(two) == sorted(one) == [1, 2, 3, 4]
  for s in two:
    np.testing.assert_allclose(two[s]["loss"], one[s]["loss"], rtol=1e-5)
    np.testing.assert_allclose(two[s]["grad_norm"], one[s]["grad_norm"], rtol=1e-5)
  assert two[4]["tokens_seen"] == one[4]["tokens_seen"]


def test_only_process_0_reports(runs):
  log1 = multihost.log_of(runs[0].parent, 1)
  assert "step      1/4" in multihost.log_of(runs[0].parent, 0) and "step " not in log1
  assert json.loads((runs[0] / "checkpoints" / "4" / "manifest.json").read_text())["process_count"] == 2


def test_manifest_digests_gathered_from_both_processes_during_training(runs):
  """Each process hashed its share in the background while training went on; process 0 wrote them all."""
  step = runs[0] / "checkpoints" / "4"
  recorded = json.loads((step / "manifest.json").read_text())["files"]
  assert len(recorded) > 2
  for name, rec in recorded.items():
    assert rec == {"size": (step / name).stat().st_size, "sha256": files.sha256_file(step / name)}, name


def test_checkpoint_moves_between_process_counts(run_cli, tmp_path, runs):
  two, one, _ = runs
  # Written by 2 processes, resumed by 1 process with 8 devices.
  w, r = _one(run_cli, tmp_path, "to_one", "--steps", "4", "--resume-from", str(two / "checkpoints" / "2"))
  assert "at step 2" in r.stdout
  # Written by 1 process, resumed by 2 processes.
  w2 = _two(tmp_path, "to_two", "--steps", "4", "--resume-from", str(one / "checkpoints" / "2"))
  ref = _records(one)
  for got in (_records(w), _records(w2)):
    for s in (3, 4):
      np.testing.assert_allclose(got[s]["loss"], ref[s]["loss"], rtol=1e-5)
      np.testing.assert_allclose(got[s]["grad_norm"], ref[s]["grad_norm"], rtol=1e-5)


@pytest.mark.parametrize("mesh, disjoint", [("dp=2,fsdp=2,tp=2,dcn.dp=2", True), ("tp=8", False)])
def test_each_process_reads_its_slice_of_the_global_batch(tmp_path, mesh, disjoint):
  procs = multihost.launch(["tests.multihost.rows", "--mesh", mesh, "--out", str(tmp_path / "rows")], 2, tmp_path,
                           env={"PYTHONPATH": REPO})
  assert multihost.wait_all(procs, TIMEOUT) == [0, 0], multihost.log_of(tmp_path, 0)[-2000:]
  parts = [np.load(tmp_path / f"rows.p{i}.npy") for i in range(2)]
  it = data.batches(config.load("tiny"))
  whole = next(it)["inputs"]
  it.close()
  if disjoint:  # data crosses hosts: each process reads its own half
    assert parts[0].shape[0] == parts[1].shape[0] == whole.shape[0] // 2
    np.testing.assert_array_equal(np.concatenate(parts), whole)
  else:  # tensor spans both hosts: both hold (and so read) the same rows
    np.testing.assert_array_equal(parts[0], whole)
    np.testing.assert_array_equal(parts[1], whole)


def _signal_process_1(tmp_path, sets, after_step: int, sig, wait_s: float):
  """Two processes run until process 0 logs `after_step`; then `sig` to process 1: (process 0's exit code, seconds
  from the signal to that exit)."""
  procs = multihost.launch([*RUN, "--workdir", "w", "--steps", "100000", *sets], 2, tmp_path)
  try:
    deadline = time.monotonic() + TIMEOUT
    while f"step {after_step:>6}/" not in multihost.log_of(tmp_path, 0):
      assert time.monotonic() < deadline and procs[0].poll() is None, multihost.log_of(tmp_path, 0)[-2000:]
      time.sleep(0.2)
    procs[1].send_signal(sig)
    sent = time.monotonic()
    code = procs[0].wait(timeout=wait_s)
    return code, time.monotonic() - sent
  finally:
    for p in procs:
      p.kill()


def test_a_lost_process_makes_the_other_exit_within_the_bound(tmp_path):
  code, took = _signal_process_1(tmp_path, ["--set", "distributed.heartbeat_timeout_s=5"], 2, signal.SIGKILL, 60)
  assert code != 0 and took < 5 + 10, (code, took)  # the heartbeat timeout, plus the abort and a loaded machine
  deadline = time.monotonic() + 10  # the line comes from the output filter, which may outlive the process
  while "error:" not in multihost.log_of(tmp_path, 0) and time.monotonic() < deadline:
    time.sleep(0.2)
  terminal = multihost.log_of(tmp_path, 0).splitlines()
  errors = [l for l in terminal[3:] if not l.startswith(("step ", "checkpoint "))]  # after the 3 start-up lines
  assert 1 <= len(errors) <= 2 and all(l.startswith("jaxtrain[process 0]: error: ") for l in errors), terminal
  assert any(re.fullmatch(r"jaxtrain\[process 0\]: error: process 1 stopped answering \(no heartbeat within "
                          r"distributed.heartbeat_timeout_s\) after step \d+, so this process stops too; (last "
                          r"committed checkpoint: step \d+|no checkpoint committed yet); run the same command on "
                          r"every process to go on \(details in .*\)", l) for l in errors), errors
  log = (tmp_path / "w" / "jaxtrain.log").read_text()
  assert "stopped sending heartbeats" in log and "\n1\n" in log  # the runtime's own text, in the run's log


def test_a_stopped_process_makes_the_other_report_the_hang_within_the_bound(tmp_path):
  """Process 1 stopped (SIGSTOP: alive, its connections open; its heartbeats given 600 s, so that the watchdog, not
  the runtime, ends the job, as for a process stuck in a kernel): process 0 waits in the step's collectives until
  the hang watchdog's bound, then prints one line, writes its stacks and the step's collectives to its log, and
  exits 3. No periodic saves: one in flight is watched with the longer bound."""
  bound = 10
  sets = ["--set", "distributed.heartbeat_timeout_s=600", "--set", f"run.hang_timeout_s={bound}",
          "--set", "checkpoint.interval=0"]
  code, took = _signal_process_1(tmp_path, sets, 3, signal.SIGSTOP, 120)
  print(f"watchdog: process 0 exited {took:.1f}s after process 1 was stopped (bound {bound}s)")
  assert code == 3 and took < bound + 10, (code, took)  # from the last completed step; plus a loaded machine
  terminal = multihost.log_of(tmp_path, 0).splitlines()
  errors = [l for l in terminal[3:] if not l.startswith(("step ", "checkpoint "))]  # after the 3 start-up lines
  assert len(errors) == 1, terminal
  assert re.fullmatch(r"jaxtrain\[process 0\]: error: no step completed for 1[01]s after step \d+ \(hang watchdog, "
                      rf"bound {bound}s: run.hang_timeout_s\), a process or a collective is stuck, so this process "
                      r"stops \(exit 3\); no checkpoint committed yet; run the same command on every process to go "
                      r"on \(stacks and the step's collectives in .*/w/jaxtrain.log\)", errors[0]), errors
  log = (tmp_path / "w" / "jaxtrain.log").read_text()
  report = log[log.index("watchdog: process 0: no step completed"):]
  # every thread's stack; the main thread's waits in the loop (for a step's metrics, or to queue the next step)
  assert "Thread 0x" in report and re.search(r'File ".*/jaxtrain/run/loop.py", line \d+ in (run|log_step)', report)
  inventory = report[report.index("collectives of the step program ("):].splitlines()
  kinds = [l.split()[0] for l in inventory[1:] if l.startswith("  ")]
  assert {"all-reduce", "all-gather"} <= set(kinds), inventory
  for line in inventory[1:len(kinds) + 1]:  # kind, bytes, replica groups, the mesh axes they span
    assert re.match(r"  [a-z\-]+ +[\d,]+ bytes  x\d+/step  (replica_groups|source_target_pairs)=[{\[m].*  first group "
                    r"\[[\d, ]+\]  mesh axes \S+  %\S+$", line), line


def test_a_process_that_never_joins_ends_the_others_at_the_start_up_deadline(tmp_path):
  """Process 1 never starts: process 0 waits distributed.init_timeout_s, then says so in one line (the heartbeats,
  which name a lost process, only run once every process has joined)."""
  procs = multihost.launch([*RUN, "--workdir", "w", "--set", "distributed.init_timeout_s=5"], 2, tmp_path)
  procs[1].kill()
  started = time.monotonic()
  code = procs[0].wait(timeout=120)
  took = time.monotonic() - started
  assert code != 0 and took < 5 + 30, (code, took)  # the deadline, plus start-up on a loaded machine
  deadline = time.monotonic() + 10
  while "error:" not in multihost.log_of(tmp_path, 0) and time.monotonic() < deadline:
    time.sleep(0.2)
  errors = [l for l in multihost.log_of(tmp_path, 0).splitlines() if "error" in l.lower()]
  assert len(errors) == 1 and errors[0].startswith("jaxtrain[process 0]: error: not every process joined within "
                                                   "distributed.init_timeout_s"), errors


NATIVE = re.compile(r"^[IWEF]\d{4} |\[Gloo\]|\[SPMD\]|is connected to \d+ peer ranks|^\s+@\s+0x")


def test_no_native_library_output_on_the_terminal(runs):
  """XLA's records (the SPMD rematerialization warnings) and gloo's connection lines go to the run's log."""
  for text in (multihost.log_of(runs[0].parent, 0), multihost.log_of(runs[0].parent, 1), runs[2]):
    assert not [l for l in text.splitlines() if NATIVE.search(l)], text
  assert "is connected to" in (runs[0] / "jaxtrain.log").read_text()  # gloo did connect: its lines are there


@pytest.fixture(scope="module")
def tp8(tmp_path_factory):
  """tp=8 over 2 processes (both hold every row), one launch for two tests: process 1 spells the shared workdir
  from another directory, --fresh over a previous run's checkpoints, held-out batches every 2 steps, and a
  metrics write failure on process 0 at step 3."""
  tmp_path = tmp_path_factory.mktemp("tp8")
  (tmp_path / "w" / "checkpoints" / "2").mkdir(parents=True)  # a previous run's checkpoints
  (tmp_path / "sub").mkdir()
  args = ["jaxtrain.train", "--mesh", "tp=8", "--steps", "100", "--fresh", "--set", "model.dtype=float32",
          "--set", "model.n_layers=1", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
          "--set", "checkpoint.interval=2", "--set", "run.tensorboard=false", "--set", "train.eval_interval=2",
          "--set", "data.eval_fraction=0.05", "--set", "data.eval_batches=1"]
  procs = multihost.launch(args, 2, tmp_path, env={"JAXTRAIN_FAULTS": "metrics_enospc_at=3"},
                           each=lambda i: (tmp_path, ["--workdir", "w"]) if i == 0 else
                           (tmp_path / "sub", ["--workdir", "../w"]))
  codes = multihost.wait_all(procs, TIMEOUT)
  return tmp_path, codes, [multihost.log_of(tmp_path, i) for i in range(2)]


def test_eval_on_processes_that_share_batch_rows(tp8):
  """tp=8 across 2 processes: both hold every row, for training and for the held-out batches."""
  tmp_path, codes, logs = tp8
  assert codes == [1, 1], logs[0][-2000:] + logs[1][-2000:]
  assert all("w/metrics.jsonl at step 3" in log for log in logs)  # both stopped for the injected failure only
  recs = _records(tmp_path / "w")
  assert "eval_loss" in recs[2] and np.isfinite(recs[2]["eval_loss"])


def test_fresh_relative_workdirs_and_a_metrics_failure_on_process_0(tp8):
  """Process 1 spells the shared workdir from another directory; --fresh moves the old checkpoints once, for
  both; a metrics write failure on process 0 stops both after one rescue checkpoint, each with one line."""
  tmp_path, codes, logs = tp8
  assert codes == [1, 1], logs[0][-2000:] + logs[1][-2000:]
  w = tmp_path / "w"
  moved = [p for p in w.iterdir() if p.name.startswith("checkpoints.fresh.")]
  assert len(moved) == 1 and (moved[0] / "2").is_dir() and f"w/{moved[0].name}" in logs[0]
  steps = checkpoint.committed_steps(w / "checkpoints")  # the rescue save at the step both agreed on, and before it
  assert len(steps) >= 2 and 3 <= steps[-1] < 100, steps
  for s in steps:  # each save's digests were exchanged between processes that spell the workdir differently
    manifest = json.loads((w / "checkpoints" / str(s) / "manifest.json").read_text())
    assert manifest["files"] and all("sha256" in f for f in manifest["files"].values())
  assert [r["step"] for r in manifest["unwritten_metrics"]] == list(range(3, steps[-1] + 1))
  for log in logs:
    line = next(l for l in log.splitlines() if "error:" in l)  # one line each, naming process 0's failure
    assert "w/metrics.jsonl at step 3: No space left" in line
    assert f"checkpoint {steps[-1]} was saved first" in line


def test_a_slow_host_is_flagged_as_the_straggler(tmp_path):
  """Process 1's host works 1 s more per step from step 12 (the fault hook): over steps 1-10 nobody is flagged;
  over 11-20 process 1 is, with its own time per step near the injected second, process 0's near nothing (it waits
  for process 1 in each step's collectives), and process 0 says so in one line. (From step 12, not 11: a record's
  interval can hold the next step's sleep, which put step 11's second into the first ten records' mean.)"""
  cwd = _two(tmp_path, "slow", "--steps", "20", "--set", "checkpoint.interval=0",
             env={"JAXTRAIN_FAULTS": "slow=1:1.0:12"}).parent
  recs = _records(cwd / "w")
  assert [s for s in recs if "stragglers" in recs[s]] == [10, 20]
  assert recs[10]["stragglers"] == [] and recs[20]["stragglers"] == [1], (recs[10], recs[20])
  own = recs[20]["process_own_s"]
  assert 0.8 < own[1] < 1.5 and own[0] < 0.5, own  # a record's interval holds the next step's sleep: 9 of 10 here
  warnings = [l for l in multihost.log_of(cwd, 0).splitlines() if "straggler" in l]
  assert len(warnings) == 1, warnings
  assert re.search(r"straggler at step 20: process 1 [\d,]+ ms of its own work per step", warnings[0]), warnings
  assert "straggler" not in multihost.log_of(cwd, 1)
