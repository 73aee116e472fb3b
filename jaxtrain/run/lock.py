"""One trainer per workdir: an OS file lock on <workdir>/jaxtrain.run.lock, held by process 0.

The lock is `filelock`'s native Unix lock, `flock(LOCK_EX | LOCK_NB)` on an open file,
tried once (no waiting): the kernel drops it when the process exits in any way (SIGKILL
included), so a crashed run never leaves a lock that blocks its requeued successor. The
file also records the holder (host, pid, since) for the message a second trainer prints;
a clean exit empties it, so a record found under a free lock is a run that died, and the
taker says so (the "stale lock" note).

What it guarantees: on one host, always. Across hosts on a shared filesystem, only where
that filesystem implements locks (NFS with a working lock manager, NFSv4, Lustre mounted
with `flock`, most parallel filesystems); on filesystems without them (e.g. object-store
FUSE mounts) `flock` either fails, which we report as a warning and run unlocked, or is
local to each host, so two hosts could both train: there the scheduler must keep one job
per workdir.
"""

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
    return True
  return True


def _describe(rec: dict) -> str:
  since = rec.get("since")
  when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
  return f"host {rec.get('host', '?')}, pid {rec.get('pid', '?')}, since {when}"


def _record(raw: bytes) -> dict:
  try:
    rec = json.loads(raw.decode() or "{}")
    return rec if isinstance(rec, dict) else {}
  except ValueError:
    return {}


class WorkdirLock:
  """`acquire()` or a one-line user error naming the holder; `release()` on the way out."""

  def __init__(self, workdir: Path):
    self.path = Path(workdir) / NAME
    self.note: str | None = None  # set when a dead run's record was taken over
    self._claimed = False  # the record is ours (locked, or unlocked where the filesystem has no locks)
    # One attempt, no waiting; never the soft (marker-file) fallback: unlink-on-release would lose the record.
    self._lock = filelock.UnixFileLock(self.path, thread_local=False, blocking=False, fallback_to_soft=False,
                                       preserve_lock_file=True, on_acquired=self._claim)

  def _claim(self, fd: int) -> None:
    """Under the lock: note a record left by a run that did not exit cleanly, write ours."""
    try:
      old = _record(os.pread(fd, 4096, 0))
    except OSError:
      old = {}
    if old.get("pid"):
      here = old.get("host") == socket.gethostname()
      state = ("that process is gone" if not _alive(int(old["pid"])) else "that pid now belongs to another process") \
          if here else "it did not release the lock cleanly (crashed?)"
      self.note = f"lock: taking over the stale lock of a previous run ({_describe(old)}): {state}"
      print(self.note, flush=True)
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}).encode()
    try:  # the record only serves messages: a full disk must not stop the run here
      os.ftruncate(fd, 0)
      os.pwrite(fd, body, 0)
    except OSError:
      pass
    self._claimed = True

  def acquire(self) -> WorkdirLock:
    try:
      self._lock.acquire()
    except filelock.Timeout:
      try:
        holder = _record(self.path.read_bytes()[:4096])
      except OSError:
        holder = {}
      raise UserError(f"workdir {self.path.parent} is in use by another trainer ({_describe(holder)}; lock file "
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
