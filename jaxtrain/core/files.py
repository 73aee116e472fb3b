"""File helpers every writer shares: content digests, crash-safe writes, OS error text."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from jaxtrain.core.errors import UserError


def sha256_file(path: Path) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def write_atomic(path: Path, text: str) -> None:
  """A crash leaves the old file or the new one, never a torn one."""
  path = Path(path)
  tmp = path.with_name(path.name + ".tmp")
  try:
    with tmp.open("w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:  # a full disk leaves no torn .tmp beside the file either
    with contextlib.suppress(OSError):
      tmp.unlink()
    raise


def write_json_atomic(path: Path, obj, indent: int = 1) -> None:
  write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def errno_text(code: int) -> str:
  """'No space left on device (ENOSPC)'."""
  return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"


def errno_of(e: BaseException) -> int | None:
  """The OS error code an exception carries, also where a library only put it in its text (tensorstore:
  os_error_code=28, safetensors: os error 28)."""
  if isinstance(getattr(e, "errno", None), int) and e.errno:
    return e.errno
  m = re.search(r"os_error_code='?(\d+)|os error (\d+)|\[Errno (\d+)\]", str(e))
  return int(next(g for g in m.groups() if g)) if m else None


def errno_in_chain(e: BaseException) -> int | None:
  """The code that explains a failure: ENOSPC wherever it lies in the cause/context chain (a full disk is the root
  cause, whatever was raised while handling it), else the outermost code."""
  chain, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    chain.append(e)
    e = e.__cause__ or e.__context__
  codes = [c for c in map(errno_of, chain) if c]
  return errno.ENOSPC if errno.ENOSPC in codes else (codes[0] if codes else None)


def user_path(text: str, flag: str) -> Path:
  """A path from the command line, made absolute once for every command (orbax needs absolute
  paths; a relative one means the same whichever module reads it)."""
  if not text or not text.strip():
    raise UserError(f"{flag} {text!r}: give a path")
  return Path(text).expanduser().absolute()


def check_output_dir(path: Path, flag: str) -> None:
  """A UserError unless `path` is, or can be made, a directory this process may write: checked
  before anything is written, so a refused command leaves nothing behind."""
  existing = next(p for p in (path, *path.parents) if p.exists())
  if not existing.is_dir():
    raise UserError(f"{flag} {path}: {existing} is not a directory")
  try:  # creating a file is the one test that holds for every user and filesystem (access() misleads root)
    with tempfile.TemporaryFile(dir=existing):
      pass
  except OSError as e:
    raise UserError(f"{flag} {path}: {existing} is not writable ({errno_text(e.errno)})") from None
