"""File helpers every writer shares: content digests, crash-safe writes, OS error text."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path


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
