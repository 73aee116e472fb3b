"""The training loop: set-up, resume, steps with metrics one step late, checkpoints, eval, preemption."""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxtrain import data
from jaxtrain.analysis import fit
from jaxtrain.core import config, parse, ramp as ramp_lib
from jaxtrain.core.config import ALLOW_MISMATCH, OPTIMIZER_SWITCH as SWITCH
from jaxtrain.core.errors import UserError
from jaxtrain.interop import tasks as tasks_lib
from jaxtrain.model import flops
from jaxtrain.parallel import devices, mesh as mesh_lib, pipeline
from jaxtrain.run import checkpoint, faults, goodput, lock as lock_lib, metrics, observe, progress as progress_lib
from jaxtrain.run import dpo, optimizer as optim_lib, runfiles, trackers
from jaxtrain.run import step as step_lib
from jaxtrain.run import checklist as checklist_lib
from jaxtrain.run import watchdog as watchdog_lib


@dataclasses.dataclass
class Summary:
  steps: int = 0
  skipped: int = 0
  final_loss: float | None = None
  last: dict | None = None  # the last metrics record
  compiled_sizes: list = dataclasses.field(default_factory=list)  # global batch of each step compile, in order


class StepPrograms:
  """The compiled step of each global batch size (train.batch_ramp), each compiled once per process when its first
  batch comes (the persistent compilation cache may serve it)."""

  def __init__(self, setup, dog, summary: Summary):
    self.setup, self.dog, self.summary, self.fns = setup, dog, summary, {}

  def compile(self, state, batch):
    rows = batch["inputs"].shape[0]
    if rows not in self.fns:
      self.fns[rows] = self.setup.step.lower(state, batch).compile()
      self.summary.compiled_sizes.append(rows)
    return self.fns[rows]

  def has(self, batch) -> bool:
    return batch["inputs"].shape[0] in self.fns

  def compile_new(self, state, batch) -> float:
    """A new size of the ramp, compiled between steps (no hang, nor a step's time); returns its seconds."""
    t = time.perf_counter()
    with self.dog.slow():
      self.compile(state, batch)
    took = time.perf_counter() - t
    print(f"batch ramp: the step for {batch['inputs'].shape[0]} sequences compiled in {took:.1f}s", flush=True)
    return took

  def __call__(self, state, batch):
    return self.fns[batch["inputs"].shape[0]](state, batch)


class Evaluator:
  """params -> {eval_loss, eval_ppl} (device scalars) over the fixed held-out batches; beside it `tasks`, the
  lm-eval tasks of train.eval_tasks (their names checked here, before the run writes anything)."""

  def __init__(self, cfg, setup, workdir: Path):
    self.cadence = progress_lib.Every(cfg.train.eval_interval)
    self.tasks = tasks_lib.DuringTraining(cfg, setup, workdir, writer=jax.process_index() == 0)
    if not self.cadence.n:
      return
    self.held = [setup.device_batch(b) for b in data.eval_batches(cfg, *setup.placement.rows())]
    self.compiled = setup.eval_step.lower(jax.eval_shape(setup.init)["params"], self.held[0]).compile()

  def due(self, step: int) -> bool:
    """Whether step s evaluates (held-out loss, train.eval_tasks)."""
    return self.cadence.due(step) or self.tasks.due(step)

  def __call__(self, params) -> dict:
    """Runs to the end: {eval_loss, eval_ppl} as host floats. Summed on the host: eager device arithmetic would
    compile a handful of small programs at the first eval, inside a step's timing."""
    outs = jax.device_get([self.compiled(params, b) for b in self.held])
    loss = float(sum(np.float64(o["loss_sum"]) for o in outs)) / max(sum(int(o["tokens"]) for o in outs), 1)
    return {"eval_loss": np.float64(loss), "eval_ppl": np.exp(np.float64(loss))}


class Preemption:
  """SIGTERM: checkpoint at the current step and exit 0 (several processes: agreed by JAX's coordination)."""

  def __init__(self, multi_process: bool):
    self.multi, self.requested = multi_process, False
    self._old = None if multi_process else signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    self.requested = True
    print("SIGTERM: will checkpoint after the current step and exit", flush=True)

  def check(self, step: int) -> bool:
    if self.multi and not self.requested:
      from jax.experimental import multihost_utils
      self.requested = multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def close(self):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


# the keys whose change leaves the saved optimizer state unusable, and what differs in it
STATE_KEYS = {"optim.name": "AdamW's two moments, Muon's one",
              "optim.state_dtype": "float32, bfloat16, or int8 codes and scales"}
# the keys a switch of optimizer frees: those, and what only one of the rules reads
SWITCH_KEYS = (*STATE_KEYS, "optim.muon_momentum")


def allowed_mismatches(text: str) -> set[str]:
  allowed = set(parse.items(text, "--allow-mismatch"))
  if "all" in allowed:
    return set(ALLOW_MISMATCH)
  if bad := allowed - set(ALLOW_MISMATCH):
    raise UserError(f"--allow-mismatch {','.join(sorted(bad))}: unknown; use {', '.join(ALLOW_MISMATCH)} or all")
  return allowed


def switches_optimizer(manifest: dict, current) -> bool:
  """Whether the checkpoint of `manifest` holds another optimizer state (STATE_KEYS) than the run's fingerprint
  `current` (or config) says (not one that holds no optimizer state: an import)."""
  if checkpoint.params_only(manifest):
    return False
  now = (lambda k: checkpoint.value(current, k)) if isinstance(current, dict) else (
      lambda k: config.value_of(current, k))
  return any((was := checkpoint.value(manifest["fingerprint"], k)) is not None and was != now(k) for k in STATE_KEYS)


def _sinks(setup, workdir: Path, stop_at: int, resumed_at: int | None, carried: list | None):
  """metrics.jsonl (plus `carried` records), console and run.trackers on process 0 only."""
  if jax.process_index() != 0:
    return metrics.Sinks([])
  cfg = setup.cfg
  runfiles.prepare_metrics(workdir / "metrics.jsonl", resumed_at, carried)
  sinks = [runfiles.JsonlWriter(workdir / "metrics.jsonl"), metrics.ConsoleSink(stop_at, cfg.run.log_every)]
  names = cfg.run.tracker_names()
  if "tensorboard" in names:
    sinks.append(metrics.TensorBoardSink(workdir / "tb"))
  sinks += trackers.open_trackers([n for n in names if n != "tensorboard"], workdir, cfg.to_dict(),
                                  setup.plan.describe(), resumed=resumed_at is not None)
  return metrics.Sinks(sinks)


def _same_run(current: dict, allowed: set[str], setup):
  """A check of a checkpoint's manifest: one written by a different run is refused (before anything moves); an
  allowed model mismatch still needs the same parameter shapes (checked before config.json is rewritten). An
  import (parameters only) takes any LoRA keys: its base gains fresh adapters."""
  def accept(step_dir: Path, manifest: dict) -> None:
    # first what no --allow-mismatch can pass, so that the hint below is one the run then accepts
    switch = switches_optimizer(manifest, current)
    if switch and SWITCH not in allowed:  # the state holds other arrays: only a fresh state bridges it
      key, why = next((k, why) for k, why in STATE_KEYS.items()
                      if checkpoint.value(manifest["fingerprint"], k) != checkpoint.value(current, k))
      was, now = (checkpoint.value(f, key) for f in (manifest["fingerprint"], current))
      raise UserError(f"checkpoint {step_dir} was written with {key}={was!r}, this run has {key}={now!r}: the "
                      f"optimizer states differ ({why}), so the run cannot switch optimizer (state) on resume; keep "
                      f"{key}, pass --allow-mismatch {SWITCH} to start the new optimizer's state fresh (parameters, "
                      "schedule and data position resume), or --fresh")
    was, now = (checkpoint.value(f, "train.tokens") for f in (manifest["fingerprint"], current))
    if was is not None and bool(was) != bool(now):  # the state holds the position in tokens, or does not
      unit = lambda t: f"in tokens (train.tokens={t:g})" if t else "in steps (train.tokens=0)"  # noqa: E731
      raise UserError(f"checkpoint {step_dir} was written with the schedule {unit(was)}, this run has it "
                      f"{unit(now)}: the train state keeps the schedule's position only in tokens, so a run cannot "
                      "switch unit on resume; keep the unit, or --fresh")
    dpo.check_start(setup.cfg, step_dir, manifest)  # an lm run's checkpoint holds no DPO reference
    imported = checkpoint.params_only(manifest)
    if imported:
      _check_quantized_base(setup.cfg, step_dir, manifest)
    free = (config.LORA_KEYS if imported else ()) + (SWITCH_KEYS if switch or imported else ())
    differ = checkpoint.mismatches(manifest["fingerprint"], current, free)
    if "model" in differ:  # other shapes (lora_base_dtype, ...) no --allow-mismatch bridges: say which keys first
      params = (setup.base_abstract(checkpoint.quantized_base(manifest) is not None) if imported
                else setup.abstract_state()["params"])
      checkpoint.check_shapes(step_dir, params, differ["model"], adapters=not imported)
    changed = {k: v for k, v in differ.items() if k not in allowed}
    if changed:
      raise UserError(f"checkpoint {step_dir} was written by a different run: "
                      f"{'; '.join(changed.values())}; pass --allow-mismatch {','.join(changed)} to resume anyway, "
                      "or --fresh")
  return accept


def _check_quantized_base(cfg, step_dir: Path, manifest: dict) -> None:
  """An import whose base is stored quantized (a QLoRA import) is trained in that format: a dense or other base
  cannot be made from it exactly."""
  saved = checkpoint.quantized_base(manifest)
  m = cfg.model
  if saved is not None and (not m.lora_rank or m.lora_base_dtype != saved):
    raise UserError(f"checkpoint {step_dir} holds its base quantized (an import with model.lora_base_dtype={saved}): "
                    f"train it with model.lora_rank > 0 and model.lora_base_dtype={saved}, not model.lora_rank="
                    f"{m.lora_rank}, model.lora_base_dtype={m.lora_base_dtype}; or import the model again without it")


def _resume(ckpts, step_dir, setup, batches, mesh_text: str):
  """(state, Progress, manifest) from the verified, accepted `step_dir` (data moved to it)."""
  if step_dir is None:
    return None, progress_lib.Progress(), {}
  saved = checkpoint.read_manifest(step_dir)
  if checkpoint.params_only(saved):  # an import: its base; LoRA's adapters and the optimizer state start here
    quantized = checkpoint.quantized_base(saved) is not None
    base, manifest = ckpts.restore(step_dir, {"params": setup.base_abstract(quantized)}, verified=True)
    state = setup.init_from(setup.with_adapters(base["params"]))
    print("checkpoint: parameters only (an import): optimizer state created (Adam moments zero, schedule at step 0)"
          f"{', fresh LoRA adapters' if setup.cfg.model.lora_rank else ''}")
  elif switches_optimizer(saved, setup.cfg):  # --allow-mismatch optimizer: all but the other rule's state
    kept = {k: v for k, v in setup.abstract_state().items() if k != "opt"}
    kept, manifest = ckpts.restore(step_dir, kept, verified=True, partial=True)
    state = setup.fresh_optimizer(kept)
    was = ", ".join(f"{k}={checkpoint.value(saved['fingerprint'], k)}" for k in STATE_KEYS)
    print(f"checkpoint: written with {was}: {setup.cfg.optim.name}'s state created "
          f"({setup.cfg.optim.state_dtype} moments zero, schedule at update {int(state['step'])})")
  else:
    state, manifest = ckpts.restore(step_dir, setup.abstract_state(), verified=True)
  batches.set_state(manifest["data_state"])
  moved = "" if manifest["mesh"] == mesh_text else f" (written on mesh {manifest['mesh']}, resharded)"
  print(f"resumed from {step_dir} at step {manifest['progress']['step']}{moved}")
  return state, progress_lib.Progress(**manifest["progress"]), manifest


def _banner(setup, mesh, config_name: str, workdir: Path) -> str:
  """The run's first lines (what runs where, the plan); returns the mesh as text."""
  cfg, dev, mesh_text = setup.cfg, mesh.devices.flat[0], mesh_lib.describe(dict(mesh.shape))
  print(f"jaxtrain: {config_name} ({setup.n_params:,} params), compute {cfg.model.dtype}"
        f"{flops.fp8_label(cfg.model.fp8)}, mesh {mesh_text} "
        f"on {mesh.size} {dev.platform} device(s) [{dev.device_kind}], workdir {workdir}")
  print(setup.plan.describe())
  if setup.pipelined:
    print(pipeline.describe(cfg, mesh))
  if line := schedule_line(cfg):
    print(line)
  if setup.notes:
    print(f"sharding: {len(setup.notes)} dimension(s) replicated where the mesh axis does not divide them, e.g. "
          f"{setup.notes[0]}")
  return mesh_text


def schedule_line(cfg) -> str:
  """The batch ramp's sizes by step, the schedule in tokens, and optim.lr_reference_batch's scaled peak LR per
  size; empty when none is set."""
  t, o, r = cfg.train, cfg.optim, ramp_lib.of(cfg)
  parts = []
  if t.batch_ramp:
    parts.append("batch ramp: " + ", ".join(f"{size} sequences from step {first + 1}" for first, _, size in r.phases))
  if t.tokens:
    parts.append(f"schedule in tokens: {t.tokens:,.0f} valid tokens of applied updates (warmup {o.warmup_tokens:,.0f}), "
                 f"{ramp_lib.run_steps(cfg)} steps")
  if o.lr_reference_batch:
    peaks = ", ".join(f"{o.lr * optim_lib.batch_factor(o, n):.4g} at {n}" for n in r.sizes())
    parts.append(f"peak lr scaled {o.lr_batch_scaling} with batch / {o.lr_reference_batch} (a rule of thumb, not "
                 f"a theorem): {peaks}")
  return "; ".join(parts)


def _goodput_summary(ledger, workdir: Path, sinks, step: int) -> None:
  """The job so far, from the ledger (process 0): one line, and its figures to TensorBoard."""
  ledger.event("end")
  try:
    summary = goodput.summarize(goodput.read(workdir)) if ledger.path is not None else None
  except goodput.LedgerError as e:  # a line no writer of ours wrote: the run itself is done
    print(f"note: no goodput summary: {e}", file=sys.stderr)
    return
  if summary is None:
    return
  print(goodput.describe(summary))
  sinks.write_only(metrics.Tracker, step, {"goodput": summary["goodput"], "goodput_wall_s": summary["wall_s"],
                                           **{f"goodput_{k}_s": v for k, v in summary["seconds"].items()}})


def _stopped_by_loader(err, ckpts, step: int, unsaved: tuple | None = None) -> data.LoaderError:
  """The line for a batch the pipeline could not produce, once the run stands at a committed point: `unsaved`
  (state, manifest body) of `step` is saved first. The data state in it is the one before the failed fetch, so
  the same command fetches that batch again and goes on exactly as an uninterrupted run. With several processes
  the others may already be in the next step (they cannot agree on a save): the last committed checkpoint stands."""
  try:
    if unsaved is not None and jax.process_count() == 1:
      ckpts.save(step, *unsaved)
    ckpts.wait()
  except checkpoint.CheckpointError as e:
    return data.LoaderError(f"{err}; the checkpoint attempted after it failed too: {e}")
  if step == 0:
    return data.LoaderError(f"{err}; no step had run: nothing to commit; run the same command to start again")
  done = (f"checkpoint {step} is committed" if ckpts.last_committed == step
          else checkpoint.last_good(ckpts.last_committed))
  return data.LoaderError(f"{err}; {done}; run the same command to resume (it fetches that batch again)")


@dataclasses.dataclass
class _Steps:
  """The steps of one run: metrics one step late, evaluations, saves, the loader's stop, and the end."""
  cfg: object
  setup: step_lib.Setup
  batches: object
  ckpts: checkpoint.Checkpoints
  saves: progress_lib.Every
  preempt: Preemption
  profiler: observe.Profiler
  evaluate: Evaluator
  sinks: metrics.Sinks
  ledger: goodput.Ledger
  dog: watchdog_lib.Watchdog
  progress: progress_lib.Progress
  summary: Summary
  identity: dict  # the manifest's fields fixed for the run: mesh, fingerprint, config, seed, process count
  workdir: Path
  checklist: checklist_lib.Checklist | None = None

  def __post_init__(self):
    t, mesh = self.cfg.train, self.setup.mesh
    self.flops_per_row = flops.flops_per_token(self.cfg.model, t.seq_len) * t.seq_len
    self.ramp = ramp_lib.of(self.cfg)
    peak = devices.peak_flops(mesh.devices.flat[0].device_kind)
    self.peak_total = peak * mesh.size if peak else None

  def manifest_body(self) -> dict:
    out = self.sinks.writer()
    return {"progress": dataclasses.asdict(self.progress), "data_state": self.batches.get_state(), **self.identity,
            "unwritten_metrics": list(out.unwritten) if out else [], "metrics": out.take_recent() if out else []}

  def log_step(self, s, device_metrics, wait, since, params=None) -> float:
    """Writes step s's record; returns when the next step's time starts. `params`: evaluate them after the
    step's own time is taken, so that neither the eval nor its set-up counts as a step's time."""
    t = time.perf_counter()
    fetched = jax.device_get(device_metrics)
    done = time.perf_counter()
    self.checklist.waited(done - t)
    self.dog.beat(s)  # a step counts as completed once its metrics are here
    self.ledger.spent("productive", done - since - sum(wait), step=s)
    task_scalars = {}
    if params is not None:
      with self.dog.slow():
        if self.evaluate.cadence.due(s):
          fetched.update(self.evaluate(params))
        if self.evaluate.tasks.due(s):
          task_scalars = self.evaluate.tasks(s, params)
      self.ledger.spent("eval", time.perf_counter() - done)
    self.progress.count(s, int(fetched["tokens"]), bool(fetched["skipped"]))
    rec = metrics.record(s, fetched, done - since, sum(wait), self.progress,
                         self.flops_per_row * self.ramp.size(s - 1), self.peak_total)
    if self.cfg.train.batch_ramp:
      rec["batch_size"] = self.ramp.size(s - 1)
    rec.update(task_scalars)
    rec.update(self.checklist.fields(s, rec, wait))
    self.sinks.write(s, rec)
    sm = self.summary
    sm.steps, sm.skipped, sm.final_loss, sm.last = sm.steps + 1, sm.skipped + rec["skipped"], rec["loss"], rec
    self.progress.check(self.cfg.train.max_skipped_in_a_row, rec["loss_scale"])
    return done if params is None else time.perf_counter()

  def save(self, s: int, state) -> float:
    """Saves step s; returns when the next step's time starts (the save's blocking part is not a step's)."""
    t = time.perf_counter()
    with self.dog.slow():
      self.ckpts.save(s, state, self.manifest_body())
    done = time.perf_counter()
    self.ledger.spent("checkpoint", done - t)
    share = self.checklist.saved(t, done)
    print(f"checkpoint {s}: saving ({done - t:.2f}s blocking, {share:.1%} of the interval"
          f"{', async' if self.cfg.checkpoint.async_save else ''})", flush=True)
    return done

  def run(self, state, batch, compiled, stop_at: int) -> None:
    out = self.sinks.writer()  # metrics.jsonl's writer (its failures stop the run after a save); None elsewhere
    pending, wait, last_done = None, (0.0, 0.0), time.perf_counter()
    for s in range(self.progress.step + 1, stop_at + 1):
      if not compiled.has(batch):  # the ramp's next size: step s-1 logged first, the compile timed apart
        if pending:
          last_done, pending = self.log_step(*pending, last_done), None
        self.ledger.spent("compile", compiled.compile_new(state, batch))
        last_done = time.perf_counter()
      self.profiler.before(s)
      t = time.perf_counter()
      state, step_metrics = compiled(state, batch)
      self.checklist.waited(time.perf_counter() - t)  # a dispatch waits where the device queue is full
      faults.slow_point(s)
      faults.kill_point("step", s)
      self.profiler.after(s, step_metrics)
      if pending:  # step s-1's metrics: reading them waits for s-1, while s is already queued
        last_done = self.log_step(*pending, last_done)
      pending = (s, step_metrics, wait)
      stop = s == stop_at or self.preempt.check(s) or (out is not None and runfiles.must_stop(out))
      if self.evaluate.due(s):  # step s timed first, then the eval, before the next step donates state
        last_done, pending = self.log_step(*pending, last_done, params=state["params"]), None
      if stop or self.saves.due(s):
        if pending:  # the manifest's clocks must include step s
          last_done = self.log_step(*pending, last_done)
        pending, last_done = None, self.save(s, state)
      self.ckpts.poll()
      if stop:
        break
      try:
        batch, wait = self.checklist.next_batch(self.batches, self.setup.device_batch)  # (host, host-to-device) s
      except data.LoaderError as e:  # step s is complete: commit it (with the data state of the failed fetch)
        if pending:
          last_done = self.log_step(*pending, last_done)
        unsaved = None if self.saves.due(s) else (state, self.manifest_body())
        raise _stopped_by_loader(e, self.ckpts, s, unsaved) from e
      self.ledger.spent("data_wait", sum(wait), step=s + 1)  # also marks step s + 1 as started
    self.finish(out)

  def finish(self, out) -> None:
    self.dog.close()  # the last async save may take longer than a step
    t = time.perf_counter()
    self.ckpts.wait()
    self.ledger.spent("checkpoint", time.perf_counter() - t)
    runfiles.report_write_failure(out, self.progress.step)  # with several processes, a collective
    _goodput_summary(self.ledger, self.workdir, self.sinks, self.progress.step)
    if self.preempt.requested:
      print(f"preempted: checkpoint committed at step {self.progress.step}; run the same command to resume")


@dataclasses.dataclass
class _Opened:
  """What a run has opened so far, closed in reverse order whatever ends it (`close`)."""
  batches: object
  workdir: Path
  lock: object = None
  created: bool = False
  ckpts: object = None
  preempt: object = None
  profiler: object = None
  runlog: object = None
  dog: object = None
  ledger: object = None
  sinks: object = None
  failed: bool = False  # the run ends with an error (the trackers mark their runs so)

  def close(self) -> None:
    for part in (self.dog, self.profiler, self.preempt):
      if part is not None:
        part.close()
    if self.sinks is not None:
      self.sinks.close(failed=self.failed)
    self.batches.close()
    try:  # a save already in flight still gets its manifest, whatever ended the run
      if self.ckpts is not None:
        self.ckpts.close()
    except checkpoint.CheckpointError as e:
      print(f"jaxtrain: warning: {e}", file=sys.stderr)
    finally:  # orbax's own errors (a barrier timeout when a peer is gone) still close the log and free the lock
      if self.runlog is not None:
        self.runlog.close()
      if self.lock is not None and self.runlog is None:  # refused or nothing to do: no lock file or workdir left
        runfiles.remove_new(self.workdir if self.created else None, self.lock)
      elif self.lock is not None:
        self.lock.release()


def run(cfg, mesh, workdir: Path, config_name: str, *, stop_at: int | None = None, fresh: bool = False,
        resume_from: str | None = None, allow_mismatch: str = "") -> Summary:
  """Trains until `stop_at` (default train.steps) total steps."""
  allowed = allowed_mismatches(allow_mismatch)
  asked = f"--steps asks for {stop_at}" if stop_at else (
      f"train.tokens={cfg.train.tokens:g} takes {ramp_lib.run_steps(cfg)} steps" if cfg.train.tokens
      else f"train.steps is {cfg.train.steps}")
  stop_at = stop_at or ramp_lib.run_steps(cfg)
  setup = step_lib.Setup(cfg, mesh, segments=data.most_segments(cfg, stop_at))
  cfg = setup.cfg  # with what the mesh implies, as the plan line says
  fit.check(setup, cfg.run.fit_check)
  # Every check that can refuse the run comes before anything in the workdir is written, moved or created.
  current = checkpoint.fingerprint(cfg, data.tokenizer_digest(cfg), data.source_digest(cfg))
  opened = _Opened(data.batches(cfg, *setup.placement.rows()), workdir)
  summary = Summary()
  try:
    evaluate = Evaluator(cfg, setup, workdir)
    opened.created = not workdir.exists()
    runfiles.prepare_workdir(workdir)
    # One trainer per workdir, taken before anything in it is moved or removed.
    opened.lock = lock_lib.WorkdirLock(workdir).acquire() if jax.process_index() == 0 else None
    mesh_text = _banner(setup, mesh, config_name, workdir)
    ck, ckdir = cfg.checkpoint, workdir / "checkpoints"
    if fresh and ckdir.exists() and jax.process_index() == 0:  # the others wait in resume_point's collective
      print(f"--fresh: previous checkpoints moved to {runfiles.move_aside(ckdir, workdir, 'fresh')}")
    # Chosen and accepted (then later/damaged steps moved aside) before orbax lists the steps it has.
    step_dir = checkpoint.resume_point(ckdir, resume_from, ck.on_damaged, workdir / "checkpoints.aside", ck.verify,
                                       accept=_same_run(current, allowed, setup))
    at = checkpoint.read_manifest(step_dir)["progress"]["step"] if step_dir is not None else 0
    if at >= stop_at:
      print(f"nothing to do: the run is at step {at} and {asked}")
      return summary
    _open_parts(opened, cfg, at, dict(mesh.shape))
    identity = {"mesh": mesh_text, "fingerprint": current, "config": cfg.to_dict(), "seed": cfg.train.seed,
                "process_count": jax.process_count()}
    _resume_and_train(opened, setup, step_dir, evaluate, identity, stop_at, summary)
    return summary
  except Exception as e:  # noqa: BLE001 (details to the log; the terminal gets one line)
    opened.failed = True
    if opened.runlog is None:  # refused before the run's files: nothing of it is written, the log included
      raise
    raise opened.runlog.ending(e, opened.sinks.writer() if opened.sinks else None) from None
  finally:
    opened.close()


def _open_parts(opened: _Opened, cfg, at: int, mesh_shape: dict) -> None:
  """The run's checkpointer, preemption handler, profiler, log, goodput ledger and hang watchdog."""
  workdir, ckdir, ck = opened.workdir, opened.workdir / "checkpoints", cfg.checkpoint
  opened.ckpts = checkpoint.Checkpoints(ckdir, ck.keep, ck.keep_every, ck.async_save,
                                        is_writer=jax.process_index() == 0, verify=ck.verify)
  opened.preempt = Preemption(jax.process_count() > 1)
  opened.profiler = observe.Profiler(cfg.run.profile_steps, workdir / "profile", enabled=jax.process_index() == 0)
  opened.runlog = runfiles.RunLog(workdir, jax.process_index())  # library noise -> <workdir>/jaxtrain.log
  opened.ledger = goodput.Ledger(workdir if jax.process_index() == 0 else None)
  opened.ledger.event("start", t=goodput.process_start(), resumed=at)
  opened.ledger.spent("startup", time.time() - goodput.process_start())
  # From here a stuck restore, compile or step (a peer alive but stopped) ends this process with a report.
  opened.dog = watchdog_lib.Watchdog(cfg.run.hang_timeout_s, cfg.run.hang_first_step_s, opened.runlog.path,
                                     jax.process_index(), ckdir, mesh_shape=mesh_shape).start(step=at)


def _resume_and_train(opened: _Opened, setup, step_dir, evaluate, identity: dict, stop_at: int,
                      summary: Summary) -> None:
  """Restores (or initializes) the state, compiles the step and runs the steps up to `stop_at`."""
  cfg, ledger, batches, workdir = setup.cfg, opened.ledger, opened.batches, opened.workdir
  t0 = time.perf_counter()
  state, progress, manifest = _resume(opened.ckpts, step_dir, setup, batches, identity["mesh"])
  if "imported_from" in manifest:  # every checkpoint names the import (an adapter export's base) after rotation
    identity["imported_from"] = manifest["imported_from"]
  ledger.spent("restore", time.perf_counter() - t0)
  t_restored = time.perf_counter()
  if jax.process_index() == 0:  # once the checkpoint is restored: a refused or failed resume rewrites nothing
    runfiles.write_json(workdir / "config.json", cfg.to_dict())
  resumed_at = progress.step if state is not None else None
  cache = goodput.CacheCount()  # did the step come from the compilation cache?
  state = setup.init() if state is None else state
  carried = [*manifest.get("metrics", ()), *manifest.get("unwritten_metrics", ())]  # what the checkpoint covers
  opened.sinks = _sinks(setup, workdir, stop_at, resumed_at, carried)
  steps = _Steps(cfg, setup, batches, opened.ckpts, progress_lib.Every(cfg.checkpoint.interval), opened.preempt,
                 opened.profiler, evaluate, opened.sinks, ledger, opened.dog, progress, summary, identity, workdir)
  try:
    batch = setup.device_batch(next(batches))
  except data.LoaderError as e:  # no step of this run to save: the resume point (if any) is the committed one
    raise _stopped_by_loader(e, opened.ckpts, progress.step) from e
  programs = StepPrograms(setup, opened.dog, summary)
  opened.dog.compiled = programs.compile(state, batch)
  steps.checklist = checklist_lib.Checklist(jax.local_devices(), batches, setup.placement.rows()[1], setup.layout)
  note = steps.checklist.note() if jax.process_index() == 0 else ""  # no extra line: terminals stay quiet
  print(f"initialized and compiled in {time.perf_counter() - t0:.1f}s{note}", flush=True)
  cache.stop()
  ledger.spent("compile", time.perf_counter() - t_restored, cache=cache.verdict())
  steps.run(state, batch, programs, stop_at)
