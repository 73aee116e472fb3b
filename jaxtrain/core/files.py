"""File helpers every writer shares: content digests, crash-safe writes, OS error text."""

from __future__ import annotations

import errno
import hashlib
import json
import os
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
  with tmp.open("w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_json_atomic(path: Path, obj, indent: int = 1) -> None:
  write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def errno_text(code: int) -> str:
  """'No space left on device (ENOSPC)'."""
  return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"


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
