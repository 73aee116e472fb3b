"""The Hugging Face directory a run was imported from: what its import read (the weights and config.json), recorded
by size, modification time and sha256 in the import's manifest (`imported_from`), and checked again when an adapter
export names that directory as its base model."""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

from jaxtrain.core import files
from jaxtrain.core.errors import UserError


def _stat(path: Path) -> dict:
  st = path.stat()
  return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _record(hf_dir: Path, names: list[str]) -> dict[str, dict]:
  return {n: {**_stat(hf_dir / n), "sha256": files.sha256_file(hf_dir / n)} for n in names}


def record(hf_dir: Path, weight_files) -> concurrent.futures.Future:
  """{file name: {size, mtime_ns, sha256}} of config.json and the weight files, hashed in a thread beside the
  import's reads (a Future: `.result()` before the manifest is written)."""
  names = sorted({"config.json", *(Path(f).name for f in weight_files)})
  pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-source-digest")
  future = pool.submit(_record, hf_dir, names)
  pool.shutdown(wait=False)
  return future


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
