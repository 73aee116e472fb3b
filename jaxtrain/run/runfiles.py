"""The run's own files in the workdir: the directory itself, `metrics.jsonl`, `jaxtrain.log`, and the one naming
scheme for anything moved aside: <stem>.<reason>.<UTC time>[.<n>]<suffix> (docs/checkpoints.md)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from jaxtrain.core import files
from jaxtrain.core import native
from jaxtrain.core.errors import RunAborted, UserError

LOG_NAME = "jaxtrain.log"


class RunFileError(RunAborted):
  """A file of the run could not be read or written."""


def _why(e: OSError) -> str:
  return files.errno_text(e.errno) if e.errno else str(e)


def prepare_workdir(workdir: Path) -> None:
  """Creates the workdir; a file in the way or no write access is a one-line user error."""
  if workdir.exists() and not workdir.is_dir():
    raise UserError(f"--workdir {workdir}: is a file, not a directory; give a directory (created if missing)")
  try:
    workdir.mkdir(parents=True, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise UserError(f"--workdir {workdir}: a part of that path is a file; give a directory path") from None
  except OSError as e:
    raise UserError(f"--workdir {workdir}: cannot create it: {_why(e)}") from None
  probe = workdir / f".write-test.{os.getpid()}"
  try:
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise UserError(f"--workdir {workdir}: cannot write there: {_why(e)}; give a writable directory") from None


def remove_new(workdir: Path | None, lock) -> None:
  """Undoes what a run that wrote nothing made: the lock file, while still held, where it made it; then `workdir`
  (one it created) if empty."""
  if lock.created:
    with contextlib.suppress(OSError):
      lock.path.unlink()
  lock.release()
  if workdir is not None:
    with contextlib.suppress(OSError):
      workdir.rmdir()


def move_aside(path: Path, dest_dir: Path, reason: str) -> Path:
  """Renames `path` into `dest_dir` as <stem>.<reason>.<time>[.<n>]<suffix>; never over an earlier move.

  Moves are made by process 0 under the workdir lock, so the first free name stays free until the rename."""
  dest_dir.mkdir(parents=True, exist_ok=True)
  stem, suffix = (path.stem, path.suffix) if path.is_file() else (path.name, "")
  base = f"{stem}.{reason}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
  dest, n = dest_dir / f"{base}{suffix}", 1
  while dest.exists():
    dest, n = dest_dir / f"{base}.{n}{suffix}", n + 1
  path.rename(dest)
  return dest


def write_json(path: Path, obj) -> None:
  """A small run file (config.json), written atomically; a failure is one line."""
  try:
    files.write_json_atomic(path, obj, indent=2)
  except OSError as e:
    raise RunFileError(f"cannot write {path}: {_why(e)}") from None


def strict_json(record: dict) -> str:
  """One line of strict JSON (RFC 8259): non-finite floats -> null."""
  clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
  return json.dumps(clean, allow_nan=False)


def read_metrics(path: Path) -> tuple[list[tuple[str, dict]], str | None]:
  """[(line, record)] of a metrics file, and a note if a torn last record was dropped."""
  try:
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
  except OSError as e:
    raise RunFileError(f"cannot read {path}: {_why(e)}") from None
  last = max((i for i, l in enumerate(lines) if l.strip()), default=-1)
  out, note = [], None
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
        raise ValueError("not a record with an integer 'step'")
    except ValueError as e:
      if i == last:  # the writer died mid-record: nothing after it was ever written
        note = f"{path.name}: dropped the torn last record at line {i + 1} ({len(line)} characters, unfinished write)"
        break
      raise RunFileError(f"{path}:{i + 1}: unreadable metrics record ({e}); fix or remove that line, or move "
                         "the file aside, and run again") from None
    out.append((line, rec))
  return out, note


def prepare_metrics(path: Path, resumed_at: int | None, carried: list[dict] | None = None) -> None:
  """Old file kept aside; on resume, records past the checkpoint dropped and those of `carried` (the checkpoint's
  records) that the file lacks (never written, or a torn last record) added."""
  if not path.exists() and not (resumed_at is not None and carried):
    return
  try:
    if resumed_at is None:
      print(f"previous {path.name} kept as {move_aside(path, path.parent, 'previous').name}")
      return
    records, note = read_metrics(path) if path.exists() else ([], None)
    kept = [(rec["step"], line) for line, rec in records if rec["step"] <= resumed_at]
    dropped = len(records) - len(kept)
    have = {step for step, _ in kept}
    extra = {r["step"]: strict_json(r) for r in carried or () if r.get("step") not in have
             and isinstance(r.get("step"), int) and r["step"] <= resumed_at}
    extra = sorted(extra.items())
    if note or dropped or extra:
      backup = move_aside(path, path.parent, "resumed").name if path.exists() else None
      files.write_atomic(path, "".join(line + "\n" for _, line in sorted(kept + extra, key=lambda x: x[0])))
    if note:
      print(f"metrics: {note} (old file kept as {backup})")
    if dropped:
      print(f"metrics: {dropped} record(s) after step {resumed_at} will be recomputed (old file kept as {backup})")
    if extra:
      print(f"metrics: {len(extra)} record(s) missing from {path.name} (steps "
            f"{', '.join(str(s) for s, _ in extra)}) restored from the checkpoint")
  except OSError as e:
    raise RunFileError(f"cannot prepare {path}: {_why(e)}") from None


class JsonlWriter:
  """Appends strict-JSON records to a file."""

  def __init__(self, path: Path):
    self.path, self.failure, self.signalled = path, None, False
    self.unwritten: list[dict] = []  # records after a failure: the next checkpoint carries them
    self.recent: list[dict] = []  # every record since the last checkpoint: it carries them too (`take_recent`)
    try:
      self.file = path.open("a+")  # readable too: a copy comes back from the open file if the path loses it
    except OSError as e:
      raise RunFileError(f"cannot open {path} for writing: {_why(e)}") from None

  def _recreate_if_gone(self, step: int) -> None:
    """The file deleted (or moved) during the run: records would go on into a file no one sees. It is recreated
    at its path with what the run had written, which the open file still holds."""
    try:
      st = os.stat(self.path)
      own = os.fstat(self.file.fileno())
      if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino):
        return
    except FileNotFoundError:
      pass
    self.file.flush()
    self.file.seek(0)
    old = self.file.read()
    new = self.path.open("a+")  # an OSError here is the run's write failure (the caller records it)
    new.write(old)
    new.flush()
    with contextlib.suppress(OSError):
      self.file.close()
    self.file = new
    print(f"jaxtrain: warning: {self.path} disappeared during the run (deleted or moved); recreated it at step "
          f"{step} with the {old.count(chr(10))} record(s) written before", file=sys.stderr, flush=True)

  def take_recent(self) -> list[dict]:
    """The records since the last call (the previous checkpoint): the one being saved covers them."""
    out, self.recent = self.recent, []
    return out

  def write(self, step: int, record: dict) -> None:
    from jaxtrain.run import faults
    line = strict_json(record)
    self.recent.append(json.loads(line))
    if self.failure is None:
      try:
        faults.metrics_write(step)
        self._recreate_if_gone(step)
        self.file.write(line + "\n")
        self.file.flush()
      except OSError as e:
        self.failure = f"cannot write {self.path} at step {step}: {_why(e)}"
    if self.failure is not None:
      self.unwritten.append(json.loads(line))

  def close(self) -> None:
    with contextlib.suppress(OSError):  # the failure, if any, was already recorded
      self.file.close()


def must_stop(writer: JsonlWriter) -> bool:
  """After a write failure, stop at this step (to save it). With several processes, only process 0 knows: it
  raises a preemption notice (SIGTERM, caught by JAX's preemption service), so that all processes stop and
  save at the step the service agrees on; `shared_failure` then tells them why."""
  if writer.failure is None:
    return False
  import jax
  if jax.process_count() == 1:
    return True
  if not writer.signalled:
    writer.signalled = True
    os.kill(os.getpid(), signal.SIGTERM)
  return False


def shared_failure(writer: JsonlWriter | None) -> str | None:
  """Collective at a stop every process agreed on: process 0's write failure (or None) on every process."""
  import jax
  text = writer.failure if writer is not None and writer.failure else ""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    from jaxtrain.run import filecheck
    text = filecheck.unpack(multihost_utils.broadcast_one_to_all(filecheck.pack(text, filecheck.TEXT_BYTES)))
    text = f"process 0: {text}" if text and jax.process_index() else text
  return text or None


def report_write_failure(writer: JsonlWriter | None, saved_step: int | None) -> None:
  """The one line that ends a run stopped by a write failure (process 0's, on every process), once saved."""
  if (failure := shared_failure(writer)) is not None:
    raise RunFileError(f"{failure}; checkpoint {saved_step} was saved first; "
                       "free space (or fix the file) and run the same command to resume")


class _QuietFileHandler(logging.FileHandler):
  """A log on a full disk, or in a workdir since removed: losing its lines is not worth a report, nor a traceback in
  place of the run's error (or, after the run, in the caller of whatever logs next)."""

  def handleError(self, record):  # noqa: N802
    pass

  def emit(self, record):
    with contextlib.suppress(OSError):  # opening the file (delay=True) happens outside handleError's reach
      super().emit(record)

  def flush(self):
    with contextlib.suppress(OSError):
      super().flush()

  def close(self):
    with contextlib.suppress(OSError):
      super().close()


class RunLog:
  """Routes library noise of this process into the workdir log until `close()`."""

  def __init__(self, workdir: Path, process_index: int = 0):
    self.path = workdir / (LOG_NAME if process_index == 0 else f"jaxtrain.process-{process_index}.log")
    native.tell("log", self.path)  # native libraries' records too
    self.handler = _QuietFileHandler(self.path, delay=True)
    self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    self._before = list(root.handlers)
    # Our handler replaces the terminal ones; with one installed, basicConfig() adds none.
    root.handlers = [self.handler]
    logging.captureWarnings(True)
    threading.excepthook = self._thread_exception
    sys.unraisablehook = self._unraisable
    self._log = logging.getLogger("jaxtrain")

  def _thread_exception(self, args):
    self._log.error("exception in thread %s", getattr(args.thread, "name", "?"),
                    exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

  def _unraisable(self, u):
    self._log.error("unraisable exception in %r: %s", u.object, u.err_msg or "",
                    exc_info=(u.exc_type, u.exc_value, u.exc_traceback) if u.exc_value else None)

  def ending(self, err: Exception, writer: JsonlWriter | None) -> Exception:
    """What the run raises for `err`: a run failure in one line, anything else as it is (traceback logged)."""
    before = self._size()
    self._log.error("run ended: %s\n%s", err, "".join(traceback.format_exception(err)))
    self.handler.flush()
    # point to the log when it holds more than this line: what libraries logged, or the error's cause chain (if the
    # log could take it: a full disk may have refused it)
    chained = err.__cause__ is not None or err.__context__ is not None
    pointer = f" (details in {self.path})" if self._size() and (before or chained) else ""
    if isinstance(err, UserError) or not isinstance(err, RunAborted):
      return err
    if writer is not None and writer.failure is not None and not isinstance(err, RunFileError):
      err = RunFileError(f"{writer.failure}; the checkpoint attempted after it failed too: {err}")
    return type(err)(f"{err}{pointer}")

  def _size(self) -> int:
    try:
      return self.path.stat().st_size
    except OSError:
      return 0

  def close(self) -> None:
    """The log stays the destination (orbax reports after the run), beside the earlier non-terminal handlers."""
    global _after_run
    terminal = (sys.stderr, sys.__stderr__, sys.stdout, sys.__stdout__)
    kept = [h for h in self._before if not (type(h) is logging.StreamHandler and h.stream in terminal)
            and not isinstance(h, _QuietFileHandler)]
    self.handler.close()
    if _after_run is not None:
      _after_run.close()
    _after_run = _QuietFileHandler(self.path, delay=True)
    _after_run.setFormatter(self.handler.formatter)
    logging.getLogger().handlers = kept + [_after_run]


_after_run: _QuietFileHandler | None = None
