"""File helpers every writer shares: content digests and crash-safe JSON."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def sha256_file(path: Path) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def write_json_atomic(path: Path, obj, indent: int = 1) -> None:
  """Writes `obj` to `path` so that a crash leaves the old file or the new one, never a torn one."""
  path = Path(path)
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w") as f:
    json.dump(obj, f, indent=indent)
    f.write("\n")
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
