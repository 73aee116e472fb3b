"""Atomic, async, sharded checkpoints with a manifest; exact resume.

Layout: <workdir>/checkpoints/<step>/ is an orbax step directory (the train state, each
process writing its own shards) plus our manifest.json. A checkpoint is a recovery
point only when orbax has committed it (its temporary directory renamed) AND the
manifest is written. The manifest is written after the commit, from the files on disk
(size and sha256 of each), so restore can verify every byte. A step directory without a
manifest is a save that never finished: it is ignored and removed.

The manifest also holds what is not an array: the step, both token clocks, the skip
counters, the data iterator state, the mesh, config/tokenizer/data fingerprints and
library versions. Rotation runs only after a new manifest is written, so the last good
checkpoint is never deleted before its successor is committed and verified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from jaxtrain.errors import RunAborted, UserError

MANIFEST = "manifest.json"
FORMAT = 1
# Train keys that only steer the run, not the math: they may change on resume.
RUN_CONTROL_KEYS = ("log_every", "max_skipped_in_a_row", "microbatches",
                    "xla_flags", "xla_flags_extra", "tensorboard", "profile_steps")
# Model keys that choose how the same math runs, not what it computes.
MODEL_SPEED_KEYS = ("attention", "remat")
# A saved fingerprint category that any run may resume with (a step-0 import has no train or data history).
ANY = "any (step-0 import)"


@dataclasses.dataclass
class Progress:
  """Host-side run state, saved in the manifest. `step` counts consumed batches."""
  step: int = 0
  tokens_seen: int = 0
  tokens_updated: int = 0
  skipped_total: int = 0
  skipped_in_a_row: int = 0


class CheckpointError(RunAborted):
  """A save failed (e.g. disk full) or a checkpoint failed verification."""


def fingerprint(cfg, tokenizer_digest: str, data_digest: str) -> dict[str, Any]:
  """What must match for a resume to be the same run, with the fields to name a change."""
  train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in RUN_CONTROL_KEYS}
  model = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k not in MODEL_SPEED_KEYS}
  return {"model": model, "train": train,
          "tokenizer": tokenizer_digest, "data": data_digest}


def mismatches(saved: dict, current: dict) -> dict[str, str]:
  """{category: 'what changed'} for every fingerprint category that differs."""
  out = {}
  for cat in ("model", "train", "tokenizer", "data"):
    old, new = saved.get(cat), current.get(cat)
    if old == new or old == ANY:
      continue
    if isinstance(old, dict) and isinstance(new, dict):
      old = {**_defaults(cat, set(new) - set(old)), **old}  # keys added since the save had their default
      fields = [f"{cat}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k)]
      if fields:
        out[cat] = ", ".join(fields)
    else:
      out[cat] = f"{cat} digest {old} -> {new}"
  return out


def _defaults(section: str, keys: set[str]) -> dict[str, Any]:
  """Default values of config keys (a checkpoint written before a key existed ran with its default)."""
  import dataclasses as dc
  from jaxtrain import config
  cls = config.SECTIONS.get(section)
  fields = {f.name: f.default for f in dc.fields(cls)} if cls else {}
  return {k: fields[k] for k in keys if k in fields}


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with path.open("rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      h.update(chunk)
  return h.hexdigest()


def _files(step_dir: Path) -> dict[str, dict]:
  return {str(p.relative_to(step_dir)): {"size": p.stat().st_size, "sha256": _sha256(p)}
          for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _write_json_atomic(path: Path, obj) -> None:
  tmp = path.with_name(path.name + ".tmp")
  with tmp.open("w") as f:
    json.dump(obj, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _versions() -> dict[str, str]:
  import flax
  import jax
  import orbax.checkpoint as ocp
  return {"jax": jax.__version__, "flax": flax.__version__, "orbax": getattr(ocp, "__version__", "?")}


def committed_steps(directory: Path) -> list[int]:
  """Steps with a manifest, ascending."""
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and (p / MANIFEST).is_file())


def read_manifest(step_dir: Path) -> dict:
  try:
    manifest = json.loads((step_dir / MANIFEST).read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"checkpoint {step_dir}: unreadable {MANIFEST} ({e})") from None
  if manifest.get("format") != FORMAT:
    raise CheckpointError(f"checkpoint {step_dir}: manifest format {manifest.get('format')} is not {FORMAT}")
  return manifest


def verify(step_dir: Path, manifest: dict) -> None:
  """Every file the manifest lists exists with the recorded size and digest."""
  for name, rec in manifest["files"].items():
    p = step_dir / name
    if not p.is_file():
      raise CheckpointError(f"checkpoint {step_dir} is damaged: file {name} is missing")
    size = p.stat().st_size
    if size != rec["size"]:
      raise CheckpointError(f"checkpoint {step_dir} is damaged: file {name} has {size} bytes, "
                            f"the manifest recorded {rec['size']}")
    if _sha256(p) != rec["sha256"]:
      raise CheckpointError(f"checkpoint {step_dir} is damaged: file {name} does not match its recorded sha256")


def _write_each_shard_once() -> None:
  """Orbax's default "replica-parallel" save splits every replicated shard among its
  replicas with eager per-shard slices, each compiled on first use: on tiny at dp=8,tp=8
  the first save blocked 22.2 s (0.21 s without it). Each shard is written once, by its
  first replica, instead."""
  import jax
  import orbax.checkpoint as ocp
  ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)


class Checkpoints:
  """Saves and restores the train state of one run directory."""

  def __init__(self, directory: Path, keep: int, keep_every: int, async_save: bool, is_writer: bool = True):
    import orbax.checkpoint as ocp
    _write_each_shard_once()
    self.dir = Path(directory).absolute()
    self.keep, self.keep_every, self.is_writer = keep, keep_every, is_writer
    if is_writer:
      self.dir.mkdir(parents=True, exist_ok=True)
      self._remove_partial()
    # Orbax never deletes: rotation is ours, after the new manifest exists.
    options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=async_save, create=True)
    self.mgr = ocp.CheckpointManager(self.dir, options=options)
    self._pending: tuple[int, dict] | None = None  # orbax save in flight, manifest not yet written
    self._finalizer: threading.Thread | None = None
    self._error: BaseException | None = None
    self.last_committed: int | None = None

  def _remove_partial(self) -> None:
    for p in self.dir.iterdir():
      if p.is_dir() and not (p / MANIFEST).is_file() and (p.name.isdigit() or "tmp" in p.name):
        print(f"checkpoint: removing unfinished save {p.name} (no manifest: it never committed)")
        shutil.rmtree(p, ignore_errors=True)

  # -- saving ----------------------------------------------------------------------------

  def save(self, step: int, state, manifest_body: dict) -> None:
    """Starts an async save of `state` at `step`; at most one save is in flight."""
    import orbax.checkpoint as ocp
    from jaxtrain import faults
    self.wait()
    try:
      faults.before_save(step)
      self.mgr.save(step, args=ocp.args.StandardSave(state), force=True)
    except Exception as e:  # noqa: BLE001 (any storage error: report it in one line)
      raise CheckpointError(f"checkpoint save at step {step} failed: {_reason(e)}") from e
    self._pending = (step, manifest_body)

  def poll(self) -> None:
    """Cheap, called every step: once orbax has committed, write the manifest in the background."""
    self._raise_if_failed()
    if self._pending and self._finalizer is None and not self.mgr.is_saving_in_progress():
      self._start_finalizer()

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is committed and its manifest written."""
    if self._pending and self._finalizer is None:
      try:
        self.mgr.wait_until_finished()
      except Exception as e:  # noqa: BLE001
        step = self._pending[0]
        self._pending = None
        raise CheckpointError(f"checkpoint save at step {step} failed: {_reason(e)}; "
                              f"the last good checkpoint is {self.last_committed}") from e
      self._start_finalizer()
    if self._finalizer is not None:
      self._finalizer.join()
      self._finalizer = None
    self._raise_if_failed()

  def _start_finalizer(self) -> None:
    step, body = self._pending
    self._pending = None
    try:
      self.mgr.check_for_errors()
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"checkpoint save at step {step} failed: {_reason(e)}; "
                            f"the last good checkpoint is {self.last_committed}") from e
    self._finalizer = threading.Thread(target=self._finalize, args=(step, body), daemon=True)
    self._finalizer.start()

  def _finalize(self, step: int, body: dict) -> None:
    try:
      from jaxtrain import faults
      faults.before_manifest(step)
      if self.is_writer:
        step_dir = self.dir / str(step)
        manifest = {"format": FORMAT, "step": step, "written_at": time.time(), "versions": _versions(),
                    **body, "files": _files(step_dir)}
        _write_json_atomic(step_dir / MANIFEST, manifest)
        self._rotate()
      self.last_committed = step
    except BaseException as e:  # noqa: BLE001 (surfaced to the main thread by _raise_if_failed)
      self._error = CheckpointError(f"checkpoint manifest at step {step} failed: {_reason(e)}; "
                                    f"the last good checkpoint is {self.last_committed}")

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      err, self._error = self._error, None
      raise err

  def _rotate(self) -> None:
    steps = committed_steps(self.dir)
    keep = set(steps[-self.keep:])
    if self.keep_every:
      keep |= {s for s in steps if s % self.keep_every == 0}
    for s in steps:
      if s not in keep:
        shutil.rmtree(self.dir / str(s), ignore_errors=True)

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.mgr.close()

  # -- restoring -------------------------------------------------------------------------

  def locate(self, resume_from: str | None) -> Path | None:
    """The step directory to resume from: latest committed, a given step, or a path."""
    if resume_from is None:
      steps = committed_steps(self.dir)
      return self.dir / str(steps[-1]) if steps else None
    if resume_from.isdigit():
      path = self.dir / resume_from
      if not (path / MANIFEST).is_file():
        raise UserError(f"--resume-from {resume_from}: no committed checkpoint at that step; "
                        f"committed steps: {committed_steps(self.dir) or 'none'}")
      return path
    path = Path(resume_from)
    if not (path / MANIFEST).is_file():
      raise UserError(f"--resume-from {resume_from}: not a committed checkpoint directory (no {MANIFEST})")
    return path

  def restore(self, step_dir: Path, abstract_state):
    """Verified restore onto the shardings carried by `abstract_state` (any mesh)."""
    import orbax.checkpoint as ocp
    manifest = read_manifest(step_dir)
    verify(step_dir, manifest)
    own = step_dir.parent.absolute() == self.dir
    mgr = self.mgr if own else ocp.CheckpointManager(step_dir.parent.absolute())
    try:
      state = mgr.restore(manifest["step"], args=ocp.args.StandardRestore(abstract_state))
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"checkpoint {step_dir} could not be restored: {_reason(e)}") from e
    finally:
      if not own:
        mgr.close()
    self.last_committed = manifest["step"] if own else None
    return state, manifest


def _reason(e: BaseException) -> str:
  """The innermost cause of an exception, in one line."""
  while e.__cause__ is not None or e.__context__ is not None:
    e = e.__cause__ or e.__context__
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return f"{type(e).__name__}: {text}" if text else type(e).__name__
