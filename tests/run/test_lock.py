"""One trainer per workdir (`jaxtrain.run.lock`), with real second processes: a live holder
refuses the next one with a one-line message naming it, a holder killed with SIGKILL leaves
a lock the next run takes (and says whose it was), and a holder that exits lets go."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from jaxtrain.core.errors import UserError
from jaxtrain.run.lock import NAME, WorkdirLock

HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from jaxtrain.run.lock import WorkdirLock
    lock = WorkdirLock(Path(sys.argv[1])).acquire()
    print("held", flush=True)
    mode = sys.stdin.readline().strip()  # the test says how to end
    if mode == "release":
        lock.release()
    print("done", flush=True)
""")


def _holder(workdir):
  """A process holding the lock of `workdir` until told how to end (stdin)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       text=True, env=env)
  assert p.stdout.readline().strip() == "held"
  return p


def _end(p, mode):
  out, _ = p.communicate(mode + "\n", timeout=60)
  assert p.returncode == 0 and out.strip() == "done"


def _record(workdir):
  return (workdir / NAME).read_text()


def test_a_live_holder_refuses_a_second_trainer_with_one_line_naming_it(tmp_path):
  p = _holder(tmp_path)
  try:
    assert json.loads(_record(tmp_path))["pid"] == p.pid
    with pytest.raises(UserError) as e:
      WorkdirLock(tmp_path).acquire()
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"workdir {tmp_path} is in use by another trainer (host {socket.gethostname()}, pid {p.pid}, "
                          "since ")
    assert f"lock file {tmp_path / NAME}" in msg
    assert json.loads(_record(tmp_path))["pid"] == p.pid  # the refused one wrote nothing
  finally:
    _end(p, "release")
  assert _record(tmp_path) == ""  # a clean release empties the record
  lock = WorkdirLock(tmp_path).acquire()
  try:
    assert lock.note is None  # nothing stale to take over
    assert json.loads(_record(tmp_path))["pid"] == os.getpid()
  finally:
    lock.release()


def test_a_holder_killed_with_sigkill_leaves_a_lock_the_next_run_takes(tmp_path):
  p = _holder(tmp_path)
  p.send_signal(signal.SIGKILL)
  p.wait(timeout=60)
  assert p.returncode == -signal.SIGKILL
  assert json.loads(_record(tmp_path))["pid"] == p.pid  # no chance to clean up: its record stays
  lock = WorkdirLock(tmp_path).acquire()
  try:
    assert lock.note.startswith(f"lock: taking over the stale lock of a previous run (host {socket.gethostname()}, "
                                f"pid {p.pid}, since ")
    assert lock.note.endswith("that process is gone")
    assert json.loads(_record(tmp_path))["pid"] == os.getpid()
  finally:
    lock.release()
  assert _record(tmp_path) == ""


def test_a_holder_that_exits_without_releasing_lets_go(tmp_path):
  p = _holder(tmp_path)
  _end(p, "exit")  # no release(): the process ends and the kernel drops the lock
  lock = WorkdirLock(tmp_path).acquire()
  try:
    assert json.loads(_record(tmp_path))["pid"] == os.getpid()
  finally:
    lock.release()


def test_release_lets_the_same_process_take_it_again_and_is_idempotent(tmp_path):
  first = WorkdirLock(tmp_path).acquire()
  with pytest.raises(UserError, match=f"pid {os.getpid()}"):
    WorkdirLock(tmp_path).acquire()
  first.release()
  first.release()  # a second release (e.g. __del__ after the `finally`) is a no-op
  assert _record(tmp_path) == ""
  second = WorkdirLock(tmp_path).acquire()
  second.release()
  assert sorted(os.listdir(tmp_path)) == [NAME]  # the one lock file, where it always was


def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch, capsys):
  import errno
  import fcntl

  def no_locks(fd, op):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(fcntl, "flock", no_locks)
  lock = WorkdirLock(tmp_path).acquire()
  err = capsys.readouterr().err
  assert "does not support file locks" in err and "running without the one-trainer-per-workdir lock" in err
  assert json.loads(_record(tmp_path))["pid"] == os.getpid()  # the record still names the run
  lock.release()
  assert _record(tmp_path) == ""
