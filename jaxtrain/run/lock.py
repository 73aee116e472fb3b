"""One trainer per workdir: `flock(LOCK_EX | LOCK_NB)` (filelock's Unix lock, tried once) on
<workdir>/jaxtrain.run.lock, held by process 0; the kernel drops it when the process dies. The file
records the holder (host, pid, since) and a clean exit empties it, so a record under a free lock
is a run that died. Guarantees across hosts: docs/checkpoints.md."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

import filelock

from jaxtrain.core.errors import UserError

NAME = "jaxtrain.run.lock"


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    pass
  return True


def _describe(rec: dict) -> str:
  since = rec.get("since")
  when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
  return f"host {rec.get('host', '?')}, pid {rec.get('pid', '?')}, since {when}"


def _record(read) -> dict:
  """The holder's record from `read()` (its first 4096 bytes); {} when unreadable or not a record."""
  try:
    rec = json.loads(read()[:4096].decode() or "{}")
    return rec if isinstance(rec, dict) else {}
  except (OSError, ValueError):
    return {}


class WorkdirLock:
  """`acquire()` or a one-line user error naming the holder; `release()` on the way out."""

  def __init__(self, workdir: Path):
    self.path = Path(workdir) / NAME
    self.created = not self.path.exists()  # a refused run removes the lock file it made
    self.note: str | None = None  # set when a dead run's record was taken over
    self._claimed = False  # the record is ours (locked, or unlocked where the filesystem has no locks)
    # One attempt, no waiting; never the soft (marker-file) fallback: unlink-on-release would lose the record.
    self._lock = filelock.UnixFileLock(self.path, thread_local=False, blocking=False, fallback_to_soft=False,
                                       preserve_lock_file=True, on_acquired=self._claim)

  def _claim(self, fd: int) -> None:
    """Under the lock: note a record left by a run that did not exit cleanly, write ours."""
    old = _record(lambda: os.pread(fd, 4096, 0))
    if old.get("pid"):
      here = old.get("host") == socket.gethostname()
      state = ("that process is gone" if not _alive(int(old["pid"])) else "that pid now belongs to another process") \
          if here else "it did not release the lock cleanly (crashed?)"
      self.note = f"lock: taking over the stale lock of a previous run ({_describe(old)}): {state}"
      print(self.note, flush=True)
    try:  # the record only serves messages: a full disk must not stop the run here
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode(), 0)
    except OSError:
      pass
    self._claimed = True

  def acquire(self) -> WorkdirLock:
    try:
      self._lock.acquire()
    except filelock.Timeout:
      holder = _describe(_record(self.path.read_bytes))
      raise UserError(f"workdir {self.path.parent} is in use by another trainer ({holder}; lock file "
                      f"{self.path}); wait for it to finish or stop it, or use another --workdir") from None
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        raise
      print(f"jaxtrain: warning: the filesystem of {self.path.parent} does not support file locks "
            f"({os.strerror(e.errno)}); running without the one-trainer-per-workdir lock", file=sys.stderr)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
      try:
        self._claim(fd)
      finally:
        os.close(fd)
    return self

  def __del__(self):  # a run() that failed before its `finally` still lets go in-process
    self.release()

  def release(self) -> None:
    """Empties the record (a clean exit) and drops the lock."""
    if not getattr(self, "_claimed", False):  # also: __init__ failed
      return
    self._claimed = False
    try:
      os.truncate(self.path, 0)  # still under the lock: nobody else writes the record
    except OSError:
      pass
    finally:
      if self._lock.is_locked:
        self._lock.release()
