"""The restart supervisor: its policy against scripted trainers (fast), and real 2-process jobs with one trainer
killed mid-step, during an async save and during a restore, against an uninterrupted job (slow)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxtrain.launch import supervisor
from tests.multihost import procs as multihost

# A stand-in trainer: attempt i (counted in a file) exits with CODES[i] (the last one repeats).
SCRIPT = """import os, sys, time
codes, count = [int(c) for c in sys.argv[1].split(",")], sys.argv[2]
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
if sys.argv[3] == "sleep" and n == 0:
    time.sleep(60)
sys.exit(codes[min(n, len(codes) - 1)])
"""


def _scripted(tmp_path, monkeypatch, codes, mode="run"):
  script, count = tmp_path / "trainer.py", tmp_path / "count"
  script.write_text(SCRIPT)
  monkeypatch.setattr(supervisor, "trainer_commands", lambda args, n: [
      [sys.executable, str(script), ",".join(map(str, codes)), str(count), mode]] * n)
  lines = []
  return lines, count


def _run(codes, tmp_path, monkeypatch, **policy):
  lines, count = _scripted(tmp_path, monkeypatch, codes)
  sup = supervisor.Supervisor(["--workdir", str(tmp_path / "w")], supervisor.Policy(backoff_s=0, **policy),
                              say=lines.append)
  return sup.run(), lines, int(count.read_text())


def test_a_failed_trainer_is_restarted_until_it_finishes(tmp_path, monkeypatch):
  code, lines, attempts = _run([1, 3, 0], tmp_path, monkeypatch, max_restarts=3)
  assert (code, attempts) == (0, 3), lines
  assert len(lines) == 2 and lines[0].startswith("trainer ended (exit 1)") and "restart 1 of at most 3" in lines[0]


def test_a_user_error_and_a_finished_run_are_not_restarted(tmp_path, monkeypatch):
  assert _run([2], tmp_path, monkeypatch)[::2] == (2, 1)
  (tmp_path / "count").unlink()
  assert _run([0], tmp_path, monkeypatch)[::2] == (0, 1)


def test_more_failures_than_max_restarts_within_the_window_stop_with_one_line(tmp_path, monkeypatch):
  code, lines, attempts = _run([1, 3, 1], tmp_path, monkeypatch, max_restarts=2)
  assert (code, attempts) == (1, 3)
  assert lines[-1] == ("error: 3 failures within 3600s (exit 1, exit 3 (hang watchdog), exit 1); more than "
                       "--max-restarts 2: stopping; the last committed checkpoint is kept"), lines


def test_failures_older_than_the_window_do_not_count(tmp_path, monkeypatch):
  code, _, attempts = _run([1, 1, 1, 0], tmp_path, monkeypatch, max_restarts=1, window_s=1e-9)
  assert (code, attempts) == (0, 4)


def test_a_signal_is_named_and_a_local_group_fails_as_one(tmp_path, monkeypatch):
  """One process of a group of 2 dies by a signal: the other (still running) is stopped, the group restarted."""
  script = tmp_path / "t.py"
  script.write_text("import os, signal, sys, time\nmarker = sys.argv[1] + '.dead'\n"
                    "if sys.argv[2] == '1' and not os.path.exists(marker):\n"
                    "    open(marker, 'w').close(); os.kill(os.getpid(), signal.SIGKILL)\n"
                    "if not os.path.exists(marker + '2'):\n    open(marker + '2', 'w').close(); time.sleep(120)\n")
  monkeypatch.setattr(supervisor, "trainer_commands", lambda args, n: [
      [sys.executable, str(script), str(tmp_path / "m"), str(i)] for i in range(n)])
  lines = []
  started = time.monotonic()
  sup = supervisor.Supervisor([], supervisor.Policy(backoff_s=0, processes=2), say=lines.append)
  assert sup.run() == 0 and time.monotonic() - started < 60, lines
  assert len(lines) == 1 and lines[0].startswith("trainer ended (signal SIGKILL)"), lines


def test_sigterm_reaches_the_trainer_and_nothing_is_restarted(tmp_path):
  """The real command: SIGTERM to the supervisor is forwarded (the trainer would save and exit 0) and ends it."""
  script = tmp_path / "t.py"
  script.write_text("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                    "print('up', flush=True)\ntime.sleep(120)\nsys.exit(1)\n")
  code = ("import sys; from jaxtrain.launch import supervisor as s, __main__ as m\n"
          f"s.trainer_commands = lambda a, n: [[sys.executable, {str(script)!r}]]\nsys.exit(m.main(['--backoff-s', '0']))")
  p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=multihost.clean_env())
  assert p.stdout.readline().strip() == "up"
  p.send_signal(signal.SIGTERM)
  assert p.wait(timeout=30) == 0
  assert "restart" not in p.stdout.read()


@pytest.mark.parametrize("argv, line", [
    (["--max-restarts", "-1"], "--max-restarts -1: must be >= 0"),
    (["--processes", "0"], "--processes 0: must be >= 1"),
    (["--processes", "2", "--", "--process-id", "1"], "--processes 2 sets the cluster flags itself; drop --process-id"),
])
def test_bad_flags_are_one_line(argv, line, run_cli):
  r = run_cli("jaxtrain.launch", *argv)
  assert r.returncode == 2 and r.stderr.strip() == f"jaxtrain.launch: error: {line}" and not r.stdout


@pytest.mark.parametrize("argv, line", [
    (["--backoff-s", "inf"], "--backoff-s inf: must be a finite number of seconds >= 0"),
    (["--backoff-s", "nan"], "--backoff-s nan: must be a finite number of seconds >= 0"),
    (["--restart-window-s", "nan"], "--restart-window-s nan: must be a finite number of seconds > 0"),
    (["--restart-window-s", "inf"], "--restart-window-s inf: must be a finite number of seconds > 0"),
    (["--restart-window-s", "-5"], "--restart-window-s -5: must be a finite number of seconds > 0"),
    (["--backoff-s=-1e-3"], "--backoff-s -0.001: must be a finite number of seconds >= 0"),
])
def test_non_finite_or_negative_times_are_one_line(argv, line, capsys, tmp_path, monkeypatch):
  """issue 54: --backoff-s inf was taken, and the supervisor then waited forever after the first failure."""
  from jaxtrain.launch import __main__ as launch
  monkeypatch.setattr(supervisor, "trainer_commands", lambda args, n: [[sys.executable, "-c", "exit(1)"]] * n)
  with pytest.raises(SystemExit) as e:
    launch.main([*argv, "--", "--workdir", str(tmp_path / "w")])
  assert e.value.code == 2 and capsys.readouterr().err == f"jaxtrain.launch: error: {line}\n"


def test_what_the_trainer_would_refuse_is_refused_once_before_any_trainer_starts(tmp_path, monkeypatch, capsys):
  """A workdir that is a file, a bad key: one line from the supervisor, no trainer started (N trainers printed it N
  times, each after JAX had set up its compilation cache in the workdir)."""
  from jaxtrain.launch import __main__ as launch
  started = tmp_path / "started"
  monkeypatch.setattr(supervisor, "trainer_commands", lambda args, n: [
      [sys.executable, "-c", f"open({str(started)!r}, 'a').write('x')"]] * n)
  (tmp_path / "a-file").write_text("")
  for argv, words in ((["--workdir", str(tmp_path / "a-file")], f"{tmp_path / 'a-file'} is not a directory"),
                      (["--workdir", str(tmp_path / "a-file" / "w")], f"{tmp_path / 'a-file'} is not a directory"),
                      (["--workdir", str(tmp_path / "w"), "--set", "train.nokey=1"], "unknown config key 'train.nokey'")):
    with pytest.raises(SystemExit) as e:
      launch.main(["--processes", "3", "--", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("jaxtrain: error: "), err
    assert words in err and not started.exists() and not (tmp_path / "w").exists(), err


def test_a_line_every_process_of_a_local_group_prints_is_printed_once(tmp_path, monkeypatch, capsys):
  """Refusals met by every trainer (the mesh, a data source): one line, not one per process; lines that differ
  (beyond the process index) all come through."""
  script = tmp_path / "t.py"
  script.write_text("import sys\ni = sys.argv[1]\nprint(f'jaxtrain[process {i}]: error: --mesh dp=5: does not divide', "
                    "file=sys.stderr)\nprint(f'own line of {i}', file=sys.stderr)\n")
  monkeypatch.setattr(supervisor, "trainer_commands", lambda args, n: [
      [sys.executable, str(script), str(i)] for i in range(n)])
  sup = supervisor.Supervisor(["--workdir", str(tmp_path / "w")], supervisor.Policy(backoff_s=0, processes=3))
  assert sup.run() == 0  # (a refusal's exit 2 would stop the others, maybe before they print: not tested here)
  lines = capsys.readouterr().err.splitlines()
  assert len([x for x in lines if "error: --mesh dp=5" in x]) == 1, lines
  assert sorted(x for x in lines if x.startswith("own line")) == ["own line of 0", "own line of 1", "own line of 2"]


def _alive(pid: int) -> bool:
  """A process that runs (a zombie nobody reaped is gone for this purpose)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except FileNotFoundError:
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_supervisor_takes_its_trainers_with_it(tmp_path):
  """SIGKILL cannot be forwarded: the trainers (here a local group of 2) die with the supervisor instead of running
  on, holding the devices and the workdir's lock, beside the supervisor a scheduler starts next."""
  script = tmp_path / "t.py"
  script.write_text("import os, sys, time\nopen(sys.argv[1] + '.' + sys.argv[2], 'w').write(str(os.getpid()))\n"
                    "time.sleep(120)\n")
  pids = tmp_path / "pid"
  code = ("import sys; from jaxtrain.launch import supervisor as s\n"
          f"s.trainer_commands = lambda a, n: [[sys.executable, {str(script)!r}, {str(pids)!r}, str(i)] for i in "
          "range(n)]\nsys.exit(s.supervise([], s.Policy(backoff_s=0, processes=2)))")
  sup = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=multihost.clean_env())
  trainers = []
  try:
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid.{i}").exists() and (tmp_path / f"pid.{i}").read_text() for i in range(2)):
      assert time.monotonic() < deadline and sup.poll() is None
      time.sleep(0.1)
    trainers = [int((tmp_path / f"pid.{i}").read_text()) for i in range(2)]
    assert all(map(_alive, trainers))
    sup.kill()
    sup.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, trainers)) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not any(map(_alive, trainers))
  finally:
    for pid in trainers:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)


# ---- real jobs: 2 processes x 4 simulated devices ---------------------------------------------------------

TRAIN = ["--mesh", "dp=2,fsdp=2,tp=2,dcn.dp=2", "--set", "model.dtype=float32", "--set", "checkpoint.interval=2",
         "--set", "distributed.heartbeat_timeout_s=5", "--workdir", "w"]
TIMEOUT = 600


def _job(cwd, steps, faults=None):
  """python -m jaxtrain.launch --processes 2 ... in `cwd`; (exit code, output, seconds)."""
  cwd.mkdir(exist_ok=True)
  env = multihost.clean_env({"JAXTRAIN_FAULTS": faults} if faults else None)
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "jaxtrain.launch", "--processes", "2", "--backoff-s", "1", "--",
                      *TRAIN, "--steps", str(steps)], cwd=cwd, env=env, capture_output=True, text=True,
                     timeout=TIMEOUT)
  return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def _losses(cwd):
  recs = [json.loads(line) for line in (cwd / "w" / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in recs}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  cwd = tmp_path_factory.mktemp("whole")
  code, out, _ = _job(cwd, 6)
  assert code == 0 and "restart" not in out, out[-3000:]
  return _losses(cwd)


@pytest.mark.slow
@pytest.mark.parametrize("where, step, process, first", [("step", 3, 1, 0), ("save", 4, 0, 0), ("restore", 2, 1, 2)])
def test_a_killed_trainer_is_restarted_and_the_job_equals_an_uninterrupted_one(
    where, step, process, first, tmp_path, uninterrupted):
  if first:  # a committed checkpoint to restore from: the first part of the job, finished
    assert _job(tmp_path, first)[0] == 0
  marker = tmp_path / "killed"
  code, out, took = _job(tmp_path, 6, f"kill={where}:{step}:{process}:{marker}")
  assert marker.exists(), out[-3000:]  # the fault fired
  assert code == 0, out[-3000:]
  restarts = [l for l in out.splitlines() if l.startswith("jaxtrain.launch: trainer ended")]
  assert len(restarts) == 1 and "signal SIGKILL" in restarts[0], out[-3000:]
  assert _losses(tmp_path) == uninterrupted  # every step, bit for bit (JSON floats round-trip exactly)
  print(f"{where} {step}: job {took:.1f}s with one restart")


def test_a_real_trainers_user_error_is_not_retried(run_cli, tmp_path):
  r = run_cli("jaxtrain.launch", "--backoff-s", "0", "--", "--set", "train.no_such_key=1", "--workdir", "w")
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("jaxtrain: error: "), r.stderr
  assert "train.no_such_key" in lines[0] and not (tmp_path / "w").exists()  # nothing written, not even a ledger
