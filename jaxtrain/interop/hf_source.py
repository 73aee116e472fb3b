"""The Hugging Face directory a run was imported from: what its import read (the weights and config.json), recorded
by size, modification time and sha256 in the import's manifest (`imported_from`), and checked again when an adapter
export names that directory as its base model."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from jaxtrain.core import files
from jaxtrain.core.errors import UserError


def _stat(path: Path) -> dict:
  st = path.stat()
  return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _record(hf_dir: Path, names: list[str]) -> dict[str, dict]:
  return {n: {**_stat(hf_dir / n), "sha256": files.sha256_file(hf_dir / n)} for n in names}


def record(hf_dir: Path, weight_files):
  """A function giving {file name: {size, mtime_ns, sha256}} of config.json and the weight files, hashed in a
  daemon thread beside the import's reads (an import that fails does not wait for it)."""
  names = sorted({"config.json", *(Path(f).name for f in weight_files)})
  box: dict = {}

  def work():
    try:
      box["files"] = _record(hf_dir, names)
    except OSError as e:
      box["error"] = UserError(f"{hf_dir}: cannot read a file of the import for its digest: {e}")
  thread = threading.Thread(target=work, name="hf-source-digest", daemon=True)
  thread.start()

  def result() -> dict[str, dict]:
    thread.join()
    if "error" in box:
      raise box["error"]
    return box["files"]
  return result


def changes(hf_dir: Path, recorded: dict[str, dict]) -> list[str]:
  """What differs from the import's record, one phrase a file: a file whose size and modification time are as
  recorded is unchanged (rsync's quick check), any other is hashed."""
  out = []
  for name, was in sorted(recorded.items()):
    path = hf_dir / name
    try:
      now = _stat(path)
      if now == {k: was.get(k) for k in now}:
        continue
      if now["size"] != was.get("size"):
        out.append(f"{name}: {was.get('size')} -> {now['size']} bytes")
      elif files.sha256_file(path) != was.get("sha256"):
        out.append(f"{name}: other contents (sha256)")
    except OSError as e:
      out.append(f"{name}: {files.errno_text(e.errno) if e.errno else e}")
  return out


def check_base(imported: dict, allow_change: bool) -> str | None:
  """The base model an adapter export names (the import's directory, None where the run was not imported): a base
  that changed since the import is refused unless `allow_change` (then a warning), a base that is gone or that
  predates the record is a warning (the adapter itself is whole)."""
  base = imported.get("dir")
  if base is None:
    return None
  where = f"the base model {base} (the run's import source, adapter_config.json's base_model_name_or_path)"
  if not Path(base).is_dir():
    print(f"jaxtrain: warning: {where} no longer exists: load the adapter onto a copy of the weights the run was "
          "imported from", file=sys.stderr)
  elif "files" not in imported:
    print(f"jaxtrain: warning: {where} is not checked: its import recorded no digests", file=sys.stderr)
  elif diff := changes(Path(base), imported["files"]):
    what = f"{where} changed since the import ({'; '.join(diff)}): the adapter was trained on the imported weights"
    if not allow_change:
      raise UserError(f"--adapter: {what}; pass --allow-base-change to write it anyway, or import the model again")
    print(f"jaxtrain: warning: {what} (--allow-base-change)", file=sys.stderr)
  return base
