"""The one check of where a command may write, made before it reads or writes anything: an output path may not be,
or lie inside, a run's own files (checkpoints, metrics, config, log, lock), a prepared dataset, a Hugging Face model
directory, or an input of the same command. A refusal is one line (UserError, exit 2).

What each kind of directory looks like on disk:
- a run workdir (jaxtrain/run/runfiles.py): checkpoints/, metrics.jsonl or the lock file jaxtrain.run.lock;
- a prepared dataset (jaxtrain/data/prepare.py): prepare.json, or a manifest.json of format jaxtrain-tokens-v1;
- a Hugging Face model directory: config.json beside *.safetensors or model.safetensors.index.json; one that
  `hf export` wrote carries EXPORT_RECORD, and only a later export may write there again."""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path
from typing import Iterable, Literal

from jaxtrain.core.errors import UserError

# The names a run owns in its workdir (moved-aside copies included: <stem>.<reason>.<time><suffix>).
RUN_NAMES = ("config.json", "metrics.jsonl", "metrics.*.jsonl", "jaxtrain.log", "jaxtrain.*.log",
             "jaxtrain.run.lock", "checkpoints", "checkpoints.*", "hf", "tokenizer.json", "*.toml", "tb", "profile")
EXPORT_RECORD = "jaxtrain_export.json"  # written by `hf export`: the files it wrote, which a rerun replaces
DATASET_FORMAT = "jaxtrain-tokens-v1"  # data/shards.py FORMAT (not imported: that module pulls in numpy)

Kind = Literal["file", "dir", "workdir", "dataset", "export"]


def is_run(d: Path) -> bool:
  return (d / "checkpoints").is_dir() or (d / "metrics.jsonl").is_file() or (d / "jaxtrain.run.lock").is_file()


def is_dataset(d: Path) -> bool:
  if (d / "prepare.json").is_file():
    return True
  try:
    with open(d / "manifest.json", "rb") as f:
      return json.loads(f.read(1 << 24)).get("format") == DATASET_FORMAT
  except (OSError, ValueError, AttributeError):
    return False


def is_hf_model(d: Path) -> bool:
  if not (d / "config.json").is_file():
    return False
  if (d / "model.safetensors.index.json").is_file():
    return True
  try:
    return any(n.endswith(".safetensors") for n in os.listdir(d))
  except OSError:
    return False


def run_file(name: str) -> bool:
  return any(fnmatch.fnmatchcase(name, p) for p in RUN_NAMES)


def _real(p: Path | str) -> Path:
  return Path(os.path.realpath(os.path.expanduser(p)))


def _inside(p: Path, d: Path) -> bool:
  return p == d or d in p.parents


def check(path: Path | str, flag: str, kind: Kind, sources: Iterable[Path | str] = ()) -> None:
  """A UserError unless writing `path` (a file, or a directory the command fills) can destroy nothing.

  kind: "file" (bench --out), "dir" (a new output directory), "workdir" (train/import: a run directory, its own
  files rewritten), "dataset" (data prepare: may be the dataset it prepares), "export" (hf export: may be an earlier
  export). `sources`: what the same command reads; the output may not be one, hold one, or lie inside one."""
  p = _real(path)
  said = f"{flag} {path}"
  for a in [*reversed(p.parents), p]:  # from the root down: the outermost owner names the problem
    if not a.is_dir():
      break
    _check_dir(a, p, said, kind)
  for s in sources:
    s = _real(s)
    if _inside(p, s) or (kind != "file" and _inside(s, p)):
      where = "is" if p == s else "lies inside" if _inside(p, s) else "holds"
      raise UserError(f"{said}: {where} {s}, which this command reads; choose an output outside its input")
  if kind == "file" and p.is_dir():
    raise UserError(f"{said}: is a directory; give a file path")


def _check_dir(a: Path, p: Path, said: str, kind: Kind) -> None:
  """The refusal if directory `a` (`p` itself or one of its parents) owns what `p` would overwrite."""
  if a == p:
    if kind == "workdir":
      if is_dataset(a) or is_hf_model(a):
        what = "a prepared dataset" if is_dataset(a) else "a Hugging Face model directory"
        raise UserError(f"{said}: is {what}; a run writes config.json and checkpoints there: choose another "
                        "directory")
      return
    if kind == "dataset" and is_dataset(a) and not is_run(a):
      return  # data prepare resumes its own dataset (prepare.json says whether it is the same job)
    if kind == "export" and (a / EXPORT_RECORD).is_file() and not is_run(a):
      return  # an earlier export: replaced (what it wrote, nothing else)
    if is_run(a):
      raise UserError(f"{said}: is a run directory (it has {_evidence(a)}); writing there would mix with or "
                      "overwrite the run's files: choose another directory")
  elif is_run(a):
    top = p.relative_to(a).parts[0]
    if run_file(top):
      raise UserError(f"{said}: lies in {a / top}, a file of the run in {a}; writing there would destroy it: "
                      "choose a path outside the run's files")
    return
  if is_dataset(a):
    raise UserError(f"{said}: {'is' if a == p else 'lies inside'} the prepared dataset {a}; writing there "
                    "would destroy it: choose a path outside it")
  if is_hf_model(a):
    raise UserError(f"{said}: {'is' if a == p else 'lies inside'} the Hugging Face model directory {a}"
                    + ("" if a != p else f" (not one `hf export` wrote: no {EXPORT_RECORD})")
                    + "; writing there would destroy it: choose another path")


def _evidence(d: Path) -> str:
  return next(n for n in ("checkpoints/", "metrics.jsonl", "jaxtrain.run.lock")
              if (d / n.rstrip("/")).exists())
