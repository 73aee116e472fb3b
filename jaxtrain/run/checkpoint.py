"""Atomic, async, sharded checkpoints: a step is committed once orbax is done and manifest.json is written."""

from __future__ import annotations

import functools
import json
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from jaxtrain.core import config
from jaxtrain.run import filecheck, runfiles
from jaxtrain.core import files
from jaxtrain.core.errors import RunAborted, UserError

MANIFEST = "manifest.json"
FORMAT = 1
# A saved fingerprint category that any run may resume with (a step-0 import has no train or data history).
ANY = "any (step-0 import)"
# The manifest's "contents" of a checkpoint holding only {"params": ...} (a Hugging Face import): the first train
# creates the optimizer state. Absent: the whole train state.
PARAMS_ONLY = "params"


class CheckpointError(RunAborted):
  """A save failed (e.g. disk full) or a checkpoint failed verification."""


def fingerprint(cfg, tokenizer_digest: str, data_digest: str) -> dict[str, Any]:
  """{category: {"section.key": value}} over the `math=True` keys that act (config.inactive: a key that changes
  nothing is left out); a `content` key: {"spec", "digest"}."""
  digests = {"data.tokenizer": tokenizer_digest, "data.source": data_digest}
  values, idle = _flat(cfg.to_dict()), config.inactive(cfg)
  out: dict[str, dict] = {c: {} for c in config.MISMATCH_CATEGORIES}
  for dotted, field in config.all_keys().items():
    cat = config.category(dotted)
    if cat is not None and dotted not in idle:
      out[cat][dotted] = ({"spec": values[dotted], "digest": digests[dotted]} if field.metadata["content"]
                          else values[dotted])
  if cfg.model.moe_experts:  # the aux loss's batch statistics and the capacity groups follow the split
    out["train"]["train.microbatches"] = cfg.train.microbatches
  return out


def _flat(sections: dict) -> dict[str, Any]:
  return {f"{s}.{k}": v for s, table in sections.items() for k, v in table.items()}


def _migrate(cat: str, saved) -> dict[str, Any]:
  """A category as written before keys declared their role (bare names, bare digests)."""
  if isinstance(saved, str):
    return {{"tokenizer": "data.tokenizer", "data": "data.source"}[cat]: {"spec": None, "digest": saved}}
  out = {}
  for k, v in (saved or {}).items():
    if "." not in k:
      k = config.RENAMED.get(f"train.{k}", f"train.{k}") if cat == "train" else f"{cat}.{k}"
    out[k] = v
  return out


def _content(v) -> str:
  if not isinstance(v, dict):
    return repr(v)
  return f"content {v['digest']}" if v.get("spec") is None else f"{v['spec']!r} (content {v['digest']})"


def value(fingerprint: dict, dotted: str):
  """A math key's value in a fingerprint; a key the checkpoint predates counts as its default; None: not recorded
  (a category a run with --allow-mismatch wrote as ANY)."""
  cat = config.category(dotted)
  if fingerprint.get(cat) == ANY:
    return None
  return _migrate(cat, fingerprint.get(cat)).get(dotted, _flat(config.Config().to_dict())[dotted])


def mismatches(saved: dict, current: dict, free: tuple[str, ...] = ()) -> dict[str, str]:
  """{category: 'what changed'}, but for the keys `free`; a key the checkpoint predates counts as its default."""
  defaults = _flat(config.Config().to_dict())
  out = {}
  for cat in config.MISMATCH_CATEGORIES:
    if saved.get(cat) == ANY:
      continue
    old, new = _migrate(cat, saved.get(cat)), current.get(cat, {})
    changed = []
    for k, now in sorted(new.items()):
      if k in free:
        continue
      was = old.get(k, defaults.get(k))
      if isinstance(now, dict):  # a content key: the digests decide
        if not isinstance(was, dict) or was.get("digest") != now["digest"]:
          changed.append(f"{k}: {_content(was)} -> {_content(now)}")
      elif was != now:
        changed.append(f"{k}: {was!r} -> {now!r}")
    if changed:
      out[cat] = ", ".join(changed)
  return out


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


def params_only(manifest: dict) -> bool:
  """Whether the checkpoint holds the parameters alone (an import), not a train state."""
  return manifest.get("contents") == PARAMS_ONLY


def quantized_base(manifest: dict) -> str | None:
  """The format of the QLoRA base the checkpoint stores (model.lora_base_dtype), None where its base is dense."""
  m = (manifest.get("config") or {}).get("model") or {}
  return m["lora_base_dtype"] if m.get("lora_rank") and m.get("lora_base_dtype", "none") != "none" else None


def verify(step_dir: Path, manifest: dict, mode: str = "full") -> None:
  """Raises unless every listed file has its size and (`full`) digest; a collective (`_problem`)."""
  if (problem := _problem(step_dir, mode, manifest)) is not None:
    raise CheckpointError(problem)


def _problem(step_dir: Path, mode: str = "full", manifest: dict | None = None) -> str | None:
  """None if the checkpoint verifies, else the one-line reason; every process takes part, manifest or not."""
  before = None
  try:
    manifest = read_manifest(step_dir) if manifest is None else manifest
    for rec in manifest["files"].values():  # the shape every process's share relies on
      int(rec["size"])
  except CheckpointError as e:
    before = str(e)
  except (OSError, KeyError, TypeError, ValueError, AttributeError) as e:  # a manifest of the wrong shape is damage too
    before = f"checkpoint {step_dir} is damaged: {_reason(e)}"
  entries = [] if before is not None or mode == "off" else list(manifest["files"].items())

  def check(i: int) -> str | None:
    name, rec = entries[i]
    p = step_dir / name
    damaged = f"checkpoint {step_dir} is damaged: file {name}"
    try:
      if not p.is_file():
        return f"{damaged} is missing"
      size = p.stat().st_size
      if size != rec["size"]:
        return f"{damaged} has {size} bytes, the manifest recorded {rec['size']}"
      if mode == "full" and rec.get("sha256") is not None and files.sha256_file(p) != rec["sha256"]:
        return f"{damaged} does not match its recorded sha256"
    except OSError as e:
      return f"{damaged} cannot be read ({e.strerror or e})"
    return None

  return filecheck.first_problem([rec["size"] for _, rec in entries], check, before)


@functools.cache
def _write_each_shard_once() -> None:
  """Each shard written once, by its first replica (orbax's replica-parallel save is slow to compile). orbax
  offers this only as a process-wide handler override (StandardSave takes no handler registry); where that
  API is missing, saves keep orbax's default (same files, a slower first save) and a note says so."""
  import jax
  import orbax.checkpoint as ocp

  def quiet(record):  # orbax warns about the override we ask for
    return not str(record.msg).startswith("Type handler registry type")
  logging.getLogger("absl").addFilter(quiet)
  try:
    ocp.type_handlers.register_type_handler(
        jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True)
  except Exception as e:  # noqa: BLE001 (an orbax without it: its default handler works, only slower)
    print(f"note: orbax's array handler could not be set ({type(e).__name__}); checkpoints use its default "
          "(replica-parallel) saving", file=sys.stderr)
  finally:
    logging.getLogger("absl").removeFilter(quiet)


class Checkpoints:
  """Saves and restores the train state of one run directory."""

  def __init__(self, directory: Path, keep: int, keep_every: int, async_save: bool, is_writer: bool = True,
               verify: str = "full", write_window: int | None = None):
    """`write_window`: the bytes orbax may hold in its write buffers at once (at least the largest array; None:
    orbax's default, 96 GB), for a save whose arrays already fill host memory (an import on CPU)."""
    import orbax.checkpoint as ocp
    _write_each_shard_once()
    self.dir = Path(directory).absolute()
    self.keep, self.keep_every, self.is_writer, self.verify = keep, keep_every, is_writer, verify
    self._saves = 0  # with the step, names each save's digest exchange: the same on every host, whatever its paths
    if is_writer:
      self.dir.mkdir(parents=True, exist_ok=True)
      for p in sorted(self.dir.iterdir()):
        if not p.is_dir() or (p / MANIFEST).is_file():
          continue
        if p.name.isdigit() and ocp.step.is_path_finalized(p):  # orbax committed it: only our manifest is missing
          dest = move_aside(p, self.dir.with_name(self.dir.name + ".aside"), "no-manifest")
          print(f"checkpoint: step {p.name} has no {MANIFEST} (lost, or the run ended before writing it); "
                f"moved it to {dest}")
        elif p.name.isdigit() or ocp.step.is_path_temporary(p):
          print(f"checkpoint: removing unfinished save {p.name} (orbax never committed it)")
          shutil.rmtree(p, ignore_errors=True)
    window = {} if write_window is None else {
        "item_handlers": ocp.StandardCheckpointHandler(save_concurrent_gb=write_window / 1e9)}
    self.mgr = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(  # orbax never deletes (we rotate)
        max_to_keep=None, enable_async_checkpointing=async_save, create=True), **window)
    self._pending: tuple[int, dict, str] | None = None  # orbax save in flight, manifest not yet written
    self._finalizer: threading.Thread | None = None
    self._error: BaseException | None = None
    self.last_committed: int | None = None

  def save(self, step: int, state, manifest_body: dict) -> None:
    """Starts an async save of `state` at `step`; at most one save is in flight."""
    import orbax.checkpoint as ocp
    from jaxtrain.run import faults
    self.wait()
    try:
      faults.before_save(step)
      self.mgr.save(step, args=ocp.args.StandardSave(state), force=True)
    except Exception as e:  # noqa: BLE001 (any storage error: report it in one line)
      self._discard(step)
      raise CheckpointError(f"checkpoint save at step {step} failed: {_reason(e)}; "
                            f"{last_good(self.last_committed)}") from e
    self._saves += 1
    self._pending = (step, manifest_body, f"jaxtrain/manifest/{step}/{self._saves}")

  def poll(self) -> None:
    """Cheap, called every step: once orbax has committed, write the manifest in the background."""
    self._raise_if_failed()
    if self._pending and self._finalizer is None and not self.mgr.is_saving_in_progress():
      self._start_finalizer()

  def wait(self) -> None:
    """Blocks until the save in flight (if any) is committed and its manifest written."""
    if self._pending and self._finalizer is None:
      self._start_finalizer(block=True)
    if self._finalizer is not None:
      self._finalizer.join()
      self._finalizer = None
    self._raise_if_failed()

  def _start_finalizer(self, block: bool = False) -> None:
    step, body, key = self._pending
    self._pending = None
    try:
      if block:
        self.mgr.wait_until_finished()
      self.mgr.check_for_errors()
    except Exception as e:  # noqa: BLE001
      self._abandon(key, e)
      self._discard(step)
      raise CheckpointError(f"checkpoint save at step {step} failed: {_reason(e)}; "
                            f"{last_good(self.last_committed)}") from e
    self._finalizer = threading.Thread(target=self._finalize, args=(step, body, key), daemon=True)
    self._finalizer.start()

  def _abandon(self, key: str, e: BaseException) -> None:
    """This save has failed here: on process 0, release the processes waiting for their share."""
    if self.verify == "full" and filecheck.processes()[1] == 0:
      filecheck.cancel(key, _reason(e))

  def _finalize(self, step: int, body: dict, key: str) -> None:
    import flax
    import jax
    import orbax.checkpoint as ocp
    try:
      step_dir = self.dir / str(step)
      recorded = self._record(step, step_dir, key)
      if self.is_writer:
        versions = {"jax": jax.__version__, "flax": flax.__version__, "orbax": getattr(ocp, "__version__", "?")}
        manifest = {"format": FORMAT, "step": step, "written_at": time.time(), "versions": versions, **body,
                    "files": recorded}
        files.write_json_atomic(step_dir / MANIFEST, manifest)
        self._rotate()
      self.last_committed = step
    except BaseException as e:  # noqa: BLE001 (surfaced to the main thread by _raise_if_failed)
      self._discard(step)
      self._error = CheckpointError(f"checkpoint manifest at step {step} failed: {_reason(e)}; "
                                    f"{last_good(self.last_committed)}")

  def _record(self, step: int, step_dir: Path, key: str) -> dict[str, dict] | None:
    """The manifest's {file: {size, sha256}} on the writer (None elsewhere); each process hashes its share."""
    from jaxtrain.run import faults
    n, me = filecheck.processes()
    shared = n > 1 and self.verify == "full"
    lister = me == 0 if shared else self.is_writer
    try:
      faults.before_manifest(step)
      faults.kill_point("save", step)
      listing = {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*"))
                 if p.is_file() and p.name != MANIFEST} if lister else None
    except BaseException as e:
      self._abandon(key, e)
      raise
    if listing is None and not shared:
      return None
    digests = filecheck.hash_to_first(step_dir, key, listing) if self.verify == "full" else {}
    if digests is None or not self.is_writer:  # (not `full`: only the writer gets here)
      return None
    return {name: {"size": size, **({"sha256": digests[name]} if digests else {})} for name, size in listing.items()}

  def _discard(self, step: int) -> None:
    """A failed save leaves nothing half-written: orbax's temporary directories of `step`, and its directory if
    it never got its manifest (it is not committed), are removed; committed steps are not touched."""
    if not self.is_writer:
      return
    step_dir = self.dir / str(step)
    for p in [*self.dir.glob(f"{step}.orbax-checkpoint-tmp*"), *([step_dir] if step_dir.is_dir() else [])]:
      if not (p / MANIFEST).is_file():
        shutil.rmtree(p, ignore_errors=True)

  def _rotate(self) -> None:
    for s in committed_steps(self.dir)[:-self.keep]:
      if not (self.keep_every and s % self.keep_every == 0):
        shutil.rmtree(self.dir / str(s), ignore_errors=True)

  def _raise_if_failed(self) -> None:
    err, self._error = self._error, None
    if err is not None:
      raise err

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.mgr.close()

  def restore(self, step_dir: Path, abstract_state, verified: bool = False, partial: bool = False):
    """Restore onto `abstract_state`'s shardings (any mesh), verified unless `verified`; every process calls it.
    `partial`: `abstract_state` names only some of the saved entries (a switch of optimizer: all but "opt").
    A parameters-only checkpoint (`params_only`) gives {"params": ...} alone, cast to the abstract dtypes (an
    import keeps the tensors' own dtypes, which widen exactly): the caller creates the rest of the state."""
    import orbax.checkpoint as ocp
    manifest = read_manifest(step_dir)
    size = sum(f["size"] for f in manifest["files"].values())
    t0 = time.perf_counter()
    print(f"checkpoint: {'restoring' if verified else 'verifying and restoring'} {step_dir} ({size / 2**30:.2f} GiB)...",
          flush=True)
    if not verified:
      verify(step_dir, manifest, self.verify)
    own = step_dir.parent.absolute() == self.dir and step_dir.name == str(manifest["step"])
    from jaxtrain.run import faults
    faults.kill_point("restore", manifest["step"])
    try:
      if params_only(manifest) or partial:  # what of the state this run takes (a LoRA import's adapters: not)
        with ocp.PyTreeCheckpointer() as reader:
          item = {"params": abstract_state["params"]} if params_only(manifest) else abstract_state
          state = reader.restore(step_dir.absolute() / "default", args=ocp.args.PyTreeRestore(
              item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
      elif own:
        state = self.mgr.restore(manifest["step"], args=ocp.args.StandardRestore(abstract_state))
      else:  # any directory name, e.g. one moved to checkpoints.aside/<step>.<reason>.<time>
        with ocp.StandardCheckpointer() as reader:
          state = reader.restore(step_dir.absolute() / "default", abstract_state)
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"checkpoint {step_dir} could not be restored: {_reason(e)}") from e
    self.last_committed = manifest["step"] if own else None
    print(f"checkpoint: restored step {manifest['step']} in {time.perf_counter() - t0:.1f}s", flush=True)
    return state, manifest


def _key_text(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def check_shapes(step_dir: Path, abstract_params, settings: str, adapters: bool = True) -> None:
  """A UserError naming the first parameter whose shape (or presence) differs between the checkpoint and
  `abstract_params`, and the model `settings` that differ ("key: was -> now"): read from orbax's metadata (no array
  is read), before anything of the run is written. `adapters=False`: the checkpoint's LoRA adapters are not
  compared (an import's: the run starts fresh ones)."""
  import jax
  import orbax.checkpoint as ocp

  from jaxtrain.model import lora
  absl = logging.getLogger("absl")
  level = absl.level
  absl.setLevel(logging.ERROR)  # "Metadata file does not exist": the step's, not the item's, is not needed here
  try:
    with ocp.PyTreeCheckpointer() as reader:
      meta = reader.metadata(Path(step_dir).absolute() / "default")
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)["params"]
  except Exception as e:  # noqa: BLE001 (orbax raises many types; the restore reports an unreadable checkpoint)
    logging.getLogger("jaxtrain").info("no shape check of %s: %s", step_dir, e)
    return
  finally:
    absl.setLevel(level)
  adapter = lambda path: any(str(getattr(k, "key", "")).endswith(lora.SUFFIX) for k in path)  # noqa: E731
  saved = {_key_text(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
           if hasattr(x, "shape") and (adapters or not adapter(p))}
  here = {_key_text(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
  for name in sorted(set(saved) | set(here)):
    if saved.get(name) != here.get(name):
      was, now = (list(d[name]) if name in d else "absent" for d in (saved, here))
      raise UserError(f"checkpoint {step_dir} does not fit this model, written by a different run ({settings}: the "
                      f"checkpoint's -> this run's): parameter {name} is {was} there and {now} here (--allow-mismatch "
                      "model resumes with other model values of the same shapes, never other shapes); resume with "
                      "the checkpoint's model settings, or pass --fresh")


def _reason(e: BaseException) -> str:
  """Why a save or restore failed, in one line: its OS error when the chain has one (ENOSPC first), else the
  innermost cause."""
  if code := files.errno_in_chain(e):
    return files.errno_text(code)
  while e.__cause__ is not None or e.__context__ is not None:
    e = e.__cause__ or e.__context__
  text = (str(e).strip().splitlines() or [""])[0]
  text = text[:300] + "..." if len(text) > 300 else text
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def last_good(step: int | None) -> str:
  return "no checkpoint has been committed yet" if step is None else f"the last good checkpoint is {step}"


def move_aside(step_dir: Path, aside: Path, reason: str) -> Path:
  """Renames a step directory to <aside>/<step>.<reason>.<time>[.<n>]: kept, out of orbax's sight."""
  return runfiles.move_aside(step_dir, aside, reason)


def choose_resume_point(directory: Path, resume_from: str | None, on_damaged: str, aside: Path,
                        problem=_problem, accept=None) -> Path | None:
  """The newest (or the named) step dir that passes `problem` (or None); once `accept(step_dir, manifest)` has not
  refused it, damaged and later ones are moved aside."""
  directory = Path(directory)
  steps = committed_steps(directory)
  damaged = []
  if resume_from is None:
    chosen = None
    for s in reversed(steps):
      reason = problem(directory / str(s))
      if reason is None:
        chosen = s
        break
      damaged.append((s, reason))
    if damaged and chosen is None:
      raise CheckpointError(f"{damaged[0][1]}; no committed checkpoint verifies (damaged: steps "
                            f"{', '.join(str(s) for s, _ in damaged)}); pass --fresh to start over "
                            "(they are moved aside, not deleted)")
    if damaged and on_damaged == "stop":
      good = [s for s in steps if s <= chosen and (s == chosen or problem(directory / str(s)) is None)]
      raise CheckpointError(f"{damaged[0][1]}; checkpoints that verify: steps {', '.join(map(str, good))}; "
                            f"resume with --resume-from {chosen} (later steps are moved aside), or set "
                            "checkpoint.on_damaged=fallback to do that automatically")
    if chosen is None:
      return None
    step_dir = directory / str(chosen)
  else:
    step_dir = directory / str(int(resume_from)) if resume_from.isdigit() else Path(resume_from)
    if not (step_dir / MANIFEST).is_file():
      raise UserError(f"--resume-from {resume_from}: " + (
          f"no committed checkpoint at that step; committed steps: {steps or 'none'}" if resume_from.isdigit()
          else f"not a committed checkpoint directory (no {MANIFEST})"))
    if (reason := problem(step_dir)) is not None:
      good = [s for s in steps if directory / str(s) != step_dir and problem(directory / str(s)) is None]
      raise CheckpointError(f"{reason}; checkpoints of this run that verify: "
                            + (f"steps {', '.join(map(str, good))} (use --resume-from {good[-1]})" if good
                               else "none (pass --fresh to start over)"))
  manifest = read_manifest(step_dir)
  if accept is not None:
    accept(step_dir, manifest)
  chosen = manifest["step"]
  for s, reason in damaged:
    dest = move_aside(directory / str(s), aside, "damaged")
    print(f"jaxtrain: warning: {reason}; moved it to {dest} and resuming from step {chosen}, the newest "
          "checkpoint that verifies", file=sys.stderr, flush=True)
  later = [s for s in committed_steps(directory) if s > chosen]
  for s in later:
    move_aside(directory / str(s), aside, "rollback")
  if later:
    print(f"rolling back to step {chosen}: later checkpoint(s) {', '.join(map(str, later))} moved to {aside} "
          "(not deleted); their metrics records are kept in the metrics.resumed.<time>.jsonl copy", flush=True)
  return step_dir


def resume_point(directory: Path, resume_from: str | None, on_damaged: str, aside: Path,
                 mode: str = "full", accept=None) -> Path | None:
  """`choose_resume_point` on process 0; its choice, verifications and failure broadcast to the others."""
  def local(name: str) -> Path:  # each process's own spelling of a step dir: hosts may mount the run elsewhere
    return Path(directory) / name if name else Path(resume_from)

  def problem(step_dir: Path) -> str | None:
    _command(_VERIFY, step_dir.name if step_dir.parent == Path(directory) else "")  # the others join in
    return _problem(step_dir, mode)

  if filecheck.processes()[1] == 0:
    try:
      step_dir = choose_resume_point(directory, resume_from, on_damaged, aside, problem, accept)
    except BaseException as e:
      known = isinstance(e, (UserError, CheckpointError))
      _command(_USER_ERROR if isinstance(e, UserError) else _FAILED,
               str(e) if known else "process 0 could not choose a checkpoint to resume from (see its message)")
      raise
    _command(*((_NONE,) if step_dir is None else (_CHOSEN, str(read_manifest(step_dir)["step"]))))
    return step_dir
  while (got := _command())[0] == _VERIFY:
    _problem(local(got[1]), mode)
  code, text = got
  if code == _CHOSEN:
    return Path(resume_from) if resume_from and not resume_from.isdigit() else Path(directory) / text
  if code == _NONE:
    return None
  raise (UserError if code == _USER_ERROR else CheckpointError)(text)


_VERIFY, _CHOSEN, _NONE, _USER_ERROR, _FAILED = range(1, 6)
_COMMAND_BYTES = 8192


def _command(code: int = 0, text: str = "") -> tuple[int, str]:
  """Process 0's (code, text) on every process (the others pass nothing); one process: as given."""
  if filecheck.processes()[0] == 1:
    return code, text
  import numpy as np
  from jax.experimental import multihost_utils
  got = multihost_utils.broadcast_one_to_all({"code": np.array([code], np.int32),
                                              "text": filecheck.pack(text, _COMMAND_BYTES)})
  return int(np.asarray(got["code"])[0]), filecheck.unpack(got["text"])
