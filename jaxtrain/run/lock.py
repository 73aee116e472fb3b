"""One trainer per workdir: an OS file lock on <workdir>/jaxtrain.run.lock, held by process 0.

The lock is `flock(LOCK_EX | LOCK_NB)` on an open file: the kernel drops it when the
process exits in any way (SIGKILL included), so a crashed run never leaves a lock that
blocks its requeued successor. The file also records the holder (host, pid, since) for the
message a second trainer prints; a clean exit empties it, so a record found under a free
lock is a run that died, and the taker says so (the "stale lock" note).

What it guarantees: on one host, always. Across hosts on a shared filesystem, only where
that filesystem implements locks (NFS with a working lock manager, NFSv4, Lustre mounted
with `flock`, most parallel filesystems); on filesystems without them (e.g. object-store
FUSE mounts) `flock` either fails, which we report as a warning and run unlocked, or is
local to each host, so two hosts could both train: there the scheduler must keep one job
per workdir.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

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


class WorkdirLock:
  """`acquire()` or a one-line user error naming the holder; `release()` on the way out."""

  def __init__(self, workdir: Path):
    self.path = Path(workdir) / NAME
    self.fd: int | None = None
    self.note: str | None = None  # set when a dead run's record was taken over

  def _read(self, fd: int) -> dict:
    try:
      rec = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
      return rec if isinstance(rec, dict) else {}
    except (OSError, ValueError):
      return {}

  def acquire(self) -> WorkdirLock:
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = self._read(fd)
      os.close(fd)
      raise UserError(f"workdir {self.path.parent} is in use by another trainer ({_describe(holder)}; lock file "
                      f"{self.path}); wait for it to finish or stop it, or use another --workdir") from None
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        os.close(fd)
        raise
      print(f"jaxtrain: warning: the filesystem of {self.path.parent} does not support file locks "
            f"({os.strerror(e.errno)}); running without the one-trainer-per-workdir lock", file=sys.stderr)
    old = self._read(fd)
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
    self.fd = fd
    return self

  def __del__(self):  # a run() that failed before its `finally` still lets go in-process
    self.release()

  def release(self) -> None:
    """Empties the record (a clean exit) and drops the lock."""
    if self.fd is None:
      return
    fd, self.fd = self.fd, None
    try:
      os.ftruncate(fd, 0)
    except OSError:
      pass
    finally:
      os.close(fd)  # closing the only descriptor releases the flock
