"""`python -m jaxtrain.train`: train a transformer on a device mesh.

    python -m jaxtrain.train --mesh dp=8,tp=8 [--config tiny] [--set train.lr=1e-3] [--steps N] [--workdir DIR]

Writes one JSON record per optimizer step to <workdir>/metrics.jsonl and a progress line
to the console. Metrics are fetched one step late so the host never stalls the device.
Running the same command again resumes from the latest committed checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from jaxtrain.errors import RunAborted, UserError, exit_with

MISMATCH_CATEGORIES = ("model", "train", "tokenizer", "data")


class _Parser(argparse.ArgumentParser):
  """argparse that reports a bad flag in one line (no usage dump)."""

  def error(self, message):
    exit_with(UserError(f"{message} (see --help)"), self.prog)


def parse_args(argv=None) -> argparse.Namespace:
  p = _Parser(prog="jaxtrain.train", description="Train a decoder-only transformer on a device mesh.")
  p.add_argument("--mesh", default="fsdp=-1",
                 help="axis=size pairs over data/fsdp/tensor/sequence/expert (aliases dp/fsdp/tp/sp/ep), "
                      "one size may be -1 to fill the rest; or a preset name from meshes/ (default: fsdp=-1)")
  p.add_argument("--config", default="tiny", help="preset name from configs/ or a path to a .toml file (default: tiny)")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                 help="override one config key (repeatable); see --help-config")
  p.add_argument("--steps", type=int,
                 help="stop once this many steps are done in total (default: train.steps); the LR schedule "
                      "still spans train.steps, so --steps 3 then --steps 6 equals one run of --steps 6")
  p.add_argument("--workdir", help="run directory: checkpoints/, metrics.jsonl, config.json (default: runs/<config>)")
  p.add_argument("--fresh", action="store_true",
                 help="start from step 0 even if the workdir has checkpoints (they are moved aside, not deleted)")
  p.add_argument("--resume-from", metavar="STEP|PATH",
                 help="resume from this committed step of the workdir, or from a checkpoint directory")
  p.add_argument("--allow-mismatch", default="", metavar="WHAT",
                 help="resume even though these differ from the checkpoint: comma list of "
                      f"{', '.join(MISMATCH_CATEGORIES)}, or all")
  p.add_argument("--coordinator", metavar="HOST:PORT", help="multi-process run: address of process 0's coordinator")
  p.add_argument("--num-processes", type=int, help="multi-process run: number of processes (one per host)")
  p.add_argument("--process-id", type=int, help="multi-process run: this process's index, 0..N-1")
  p.add_argument("--help-config", action="store_true", help="list every config key with type, default and meaning")
  return p.parse_args(argv)


class MetricsLog:
  """Turns fetched step metrics into metrics.jsonl records and console lines, and keeps
  the host-side run state (`Progress`): the clocks `tokens_seen` (valid tokens consumed)
  and `tokens_updated` (valid tokens of steps that moved the params), as Python ints so
  they never overflow, and the skip counters."""

  def __init__(self, path: Path, setup, total_steps: int, log_every: int, progress=None, resumed: bool = False):
    import jax
    from jaxtrain import checkpoint, flops
    cfg = setup.cfg
    self.progress = progress or checkpoint.Progress()
    if path is None:  # not process 0: clocks kept, nothing written
      self.file = open(os.devnull, "w")
    else:
      _prepare_metrics_file(path, self.progress.step if resumed else None)
      self.file = path.open("a", buffering=1)
    self.total, self.log_every = total_steps, log_every
    self.flops_per_step = flops.flops_per_token(cfg.model, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
    peak = flops.peak_flops(setup.mesh.devices.flat[0].device_kind)
    self.peak_total = peak * setup.mesh.size if peak else None
    self.max_skipped = cfg.train.max_skipped_in_a_row
    self._jax = jax
    self.tb = None  # an observe.EventWriter on process 0 when train.tensorboard

  # Kept as attributes for callers that read the clocks directly.
  tokens_seen = property(lambda self: self.progress.tokens_seen)
  tokens_updated = property(lambda self: self.progress.tokens_updated)

  def write(self, step: int, fetched: dict, step_time: float, data_wait: float) -> dict:
    m = {k: v.item() for k, v in fetched.items()}
    tokens, skipped = int(m["tokens"]), bool(m["skipped"])
    p = self.progress
    p.step = step
    p.tokens_seen += tokens
    p.tokens_updated += 0 if skipped else tokens
    p.skipped_total += skipped
    p.skipped_in_a_row = p.skipped_in_a_row + 1 if skipped else 0
    rec = {
        "step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"], "tokens": tokens,
        "tokens_per_sec": tokens / step_time, "step_time_s": step_time, "data_wait_s": data_wait,
        "mfu": self.flops_per_step / step_time / self.peak_total if self.peak_total else None,
        "skipped": skipped, "loss_scale": m["loss_scale"],
        "tokens_seen": p.tokens_seen, "tokens_updated": p.tokens_updated,
    }
    rec.update({k: m[k] for k in ("eval_loss", "eval_ppl") if k in m})
    rec.update({k: m[k] for k in ("moe_aux_loss", "moe_dropped_frac") if k in m})  # MoE models only
    self.file.write(json.dumps(rec) + "\n")
    if self.tb is not None:
      self.tb.scalars(step, rec)
    if step % self.log_every == 0 or step == self.total:
      mfu = f"{rec['mfu']:.1%}" if rec["mfu"] is not None else "n/a"
      print(f"step {step:>6}/{self.total}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  gnorm {rec['grad_norm']:.3f}  "
            f"tok/s {rec['tokens_per_sec']:,.0f}  step {step_time * 1e3:.0f}ms  data {data_wait * 1e3:.1f}ms  mfu {mfu}"
            + (f"  scale {rec['loss_scale']:g}" if rec["loss_scale"] != 1.0 else "")
            + ("  SKIPPED (non-finite gradients)" if skipped else "")
            + (f"  eval {rec['eval_loss']:.4f} (ppl {rec['eval_ppl']:.2f})" if "eval_loss" in rec else ""), flush=True)
    if p.skipped_in_a_row >= self.max_skipped:
      raise RunAborted(f"aborting at step {step}: {p.skipped_in_a_row} steps in a row (steps "
                       f"{step - p.skipped_in_a_row + 1}-{step}) had non-finite gradients or no valid token "
                       f"(train.max_skipped_in_a_row={self.max_skipped}); loss scale {rec['loss_scale']:g}")
    return rec

  def close(self):
    self.file.close()
    if self.tb is not None:
      self.tb.close()


def _prepare_metrics_file(path: Path, resumed_at: int | None) -> None:
  """Fresh run: keep an old file aside. Resume: drop records past the checkpoint (they
  will be recomputed), keeping the full old file aside so nothing is lost."""
  if not path.exists():
    return
  backup = path.with_name(f"metrics.{int(time.time())}.jsonl")
  if resumed_at is None:
    path.rename(backup)
    print(f"previous {path.name} kept as {backup.name}")
    return
  lines = path.read_text().splitlines()
  kept = [l for l in lines if l.strip() and json.loads(l).get("step", 0) <= resumed_at]
  if len(kept) != len(lines):
    path.rename(backup)
    path.write_text("".join(l + "\n" for l in kept))
    print(f"metrics: {len(lines) - len(kept)} record(s) after step {resumed_at} will be recomputed "
          f"(old file kept as {backup.name})")


def make_evaluator(cfg, setup):
  """params -> {eval_loss, eval_ppl} over the fixed held-out batches (token-normalized over
  all of them), as device scalars read with the step's metrics; None when eval is off."""
  if not cfg.train.eval_interval:
    return None
  import jax
  import jax.numpy as jnp
  from jaxtrain import data
  held = [setup.device_batch(b) for b in data.eval_batches(cfg, jax.process_index(), jax.process_count())]
  # Compiled now, so the first evaluation does not stall a training step with a compile.
  compiled = setup.eval_step.lower(jax.eval_shape(setup.init)["params"], held[0]).compile()

  def evaluate(params):
    outs = [compiled(params, b) for b in held]
    loss = sum(o["loss_sum"] for o in outs) / jnp.maximum(sum(o["tokens"] for o in outs), 1)
    return {"eval_loss": loss, "eval_ppl": jnp.exp(loss)}
  return evaluate


class Preemption:
  """SIGTERM: the loop checkpoints at the current step and exits 0.

  One process: our own SIGTERM flag. Several: JAX's coordination service catches the
  signal and all processes agree on the step to stop at (else they would deadlock)."""

  def __init__(self, multi_process: bool):
    self.multi, self.requested, self._old = multi_process, False, None
    if not multi_process:
      self._old = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    self.requested = True
    print("SIGTERM: will checkpoint after the current step and exit", flush=True)

  def check(self, step: int) -> bool:
    if self.multi and not self.requested:
      from jax.experimental import multihost_utils
      self.requested = multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def restore(self):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def _allowed(text: str) -> set[str]:
  allowed = {w.strip() for w in text.split(",") if w.strip()}
  if "all" in allowed:
    return set(MISMATCH_CATEGORIES)
  bad = allowed - set(MISMATCH_CATEGORIES)
  if bad:
    raise UserError(f"--allow-mismatch {','.join(sorted(bad))}: unknown; use {', '.join(MISMATCH_CATEGORIES)} or all")
  return allowed


def run(cfg, mesh, workdir: Path, config_name: str, *, stop_at: int | None = None, fresh: bool = False,
        resume_from: str | None = None, allow_mismatch: str = "") -> list[dict]:
  """Trains until `stop_at` (default train.steps) total steps; returns this run's metrics records."""
  import jax
  from jaxtrain import attention, checkpoint, data, mesh as mesh_lib, observe, pipeline, step as step_lib

  allowed = _allowed(allow_mismatch)
  stop_at = stop_at or cfg.train.steps
  setup = step_lib.Setup(cfg, mesh)
  workdir.mkdir(parents=True, exist_ok=True)
  ckdir = workdir / "checkpoints"
  if fresh and ckdir.exists():
    aside = workdir / f"checkpoints.{int(time.time())}"
    ckdir.rename(aside)
    print(f"--fresh: previous checkpoints moved to {aside}")
  if jax.process_index() == 0:
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
  dev = mesh.devices.flat[0]
  mesh_text = mesh_lib.describe(dict(mesh.shape))
  print(f"jaxtrain: {config_name} ({setup.n_params:,} params), mesh {mesh_text} "
        f"on {mesh.size} {dev.platform} device(s) [{dev.device_kind}], workdir {workdir}")
  impl, why = attention.select(cfg.model, cfg.train.seq_len)
  ring_note = ", ring attention over sequence" if mesh.shape.get("sequence", 1) > 1 else ""
  print(f"attention: {impl} ({why}{ring_note}); remat {cfg.model.remat}")
  if pipeline.active(mesh):
    print(pipeline.describe(cfg, mesh))
  if setup.notes:
    print(f"sharding: {len(setup.notes)} dimension(s) replicated where the mesh axis does not divide them, e.g. "
          f"{setup.notes[0]}")

  ck = cfg.checkpoint
  ckpts = checkpoint.Checkpoints(ckdir, ck.keep, ck.keep_every, ck.async_save, is_writer=jax.process_index() == 0)
  current = checkpoint.fingerprint(cfg, data.tokenizer_digest(cfg), data.source_digest(cfg))
  batches = data.batches(cfg, *setup.local_rows())
  evaluate = make_evaluator(cfg, setup)
  preempt = Preemption(jax.process_count() > 1)
  profiler = observe.Profiler(cfg.train.profile_steps, workdir / "profile", enabled=jax.process_index() == 0)
  log = None
  try:
    t0 = time.perf_counter()
    progress, state = None, None
    step_dir = ckpts.locate(resume_from)
    if step_dir is not None:
      manifest = checkpoint.read_manifest(step_dir)
      changed = {k: v for k, v in checkpoint.mismatches(manifest["fingerprint"], current).items() if k not in allowed}
      if changed:
        raise UserError(f"checkpoint {step_dir} was written by a different run: {'; '.join(changed.values())}; "
                        f"pass --allow-mismatch {','.join(changed)} to resume anyway, or --fresh")
      state, manifest = ckpts.restore(step_dir, setup.abstract_state())
      progress = checkpoint.Progress(**manifest["progress"])
      batches.set_state(manifest["data_state"])
      moved = "" if manifest["mesh"] == mesh_text else f" (written on mesh {manifest['mesh']}, resharded)"
      print(f"resumed from {step_dir} at step {progress.step}{moved}")
    else:
      state = setup.init()
    start = progress.step if progress else 0
    metrics_path = workdir / "metrics.jsonl" if jax.process_index() == 0 else None
    log = MetricsLog(metrics_path, setup, stop_at, cfg.train.log_every, progress, resumed=bool(progress))
    if metrics_path is not None and cfg.train.tensorboard:
      log.tb = observe.EventWriter(workdir / "tb")
    if start >= stop_at:
      print(f"nothing to do: the run is at step {start} and --steps asks for {stop_at}")
      return []

    def manifest_body():
      return {"progress": vars(log.progress).copy(), "data_state": batches.get_state(), "mesh": mesh_text,
              "fingerprint": current, "config": cfg.to_dict(), "seed": cfg.train.seed,
              "process_count": jax.process_count()}

    batch = setup.device_batch(next(batches))
    compiled = setup.step.lower(state, batch).compile()
    print(f"initialized and compiled in {time.perf_counter() - t0:.1f}s", flush=True)

    records, pending = [], None

    def log_step(step, metrics, wait, since):
      fetched = jax.device_get(metrics)  # blocks until that step is done
      done = time.perf_counter()
      records.append(log.write(step, fetched, done - since, wait))
      return done

    wait, last_done = 0.0, time.perf_counter()
    for s in range(start + 1, stop_at + 1):
      profiler.before(s)
      state, metrics = compiled(state, batch)
      profiler.after(s, metrics)
      if evaluate and s % cfg.train.eval_interval == 0:  # dispatched before the next step donates state
        metrics = {**metrics, **evaluate(state["params"])}
      if pending:  # step s-1's metrics: reading them waits for s-1, while s is already queued
        last_done = log_step(*pending, last_done)
      pending = (s, metrics, wait)
      stop = s == stop_at or preempt.check(s)
      if stop or (ck.interval and s % ck.interval == 0):
        last_done = log_step(*pending, last_done)  # the manifest's clocks must include step s
        pending = None
        t = time.perf_counter()
        ckpts.save(s, state, manifest_body())
        last_done = time.perf_counter()  # the save's blocking part is not the next step's time
        print(f"checkpoint {s}: saving ({last_done - t:.2f}s blocking{', async' if ck.async_save else ''})", flush=True)
      ckpts.poll()
      if stop:
        break
      t = time.perf_counter()
      batch = setup.device_batch(next(batches))
      wait = time.perf_counter() - t
    ckpts.wait()
    if preempt.requested:
      print(f"preempted: checkpoint committed at step {log.progress.step}; run the same command to resume")
    return records
  finally:
    profiler.close()
    preempt.restore()
    if log is not None:
      log.close()
    batches.close()
    try:  # a save already in flight still gets its manifest, whatever ended the run
      ckpts.close()
    except checkpoint.CheckpointError as e:
      print(f"jaxtrain: warning: {e}", file=sys.stderr)


def main(argv=None) -> int:
  args = parse_args(argv)
  from jaxtrain import config, distributed, mesh as mesh_lib
  if args.help_config:
    print(config.help_text())
    return 0
  prog = "jaxtrain"
  try:
    if args.steps is not None and args.steps < 1:
      raise UserError(f"--steps {args.steps}: must be a positive integer")
    if args.fresh and args.resume_from:
      raise UserError("--fresh and --resume-from contradict each other; give one")
    _allowed(args.allow_mismatch)
    cfg = config.load(args.config, args.set)
    from jaxtrain import observe, xla_flags
    observe.parse_steps(cfg.train.profile_steps)  # a bad value fails before any device starts
    added = xla_flags.apply(cfg.train.xla_flags, cfg.train.xla_flags_extra)  # before the backend starts
    if added:
      print(f"xla flags: {len(added)} added to XLA_FLAGS (preset {cfg.train.xla_flags})")
    sizes, dcn = mesh_lib.parse_full(args.mesh)
    cluster = distributed.cluster_from(args.coordinator, args.num_processes, args.process_id)
    if cluster is not None:
      prog = f"jaxtrain[process {cluster.process_id if cluster.process_id is not None else '?'}]"
    distributed.initialize(cluster, sizes, cfg.distributed.heartbeat_timeout_s, cfg.distributed.init_timeout_s)
    import jax
    if jax.process_count() > 1:
      prog = f"jaxtrain[process {jax.process_index()}]"
      if jax.process_index() != 0:  # process 0 alone reports progress
        sys.stdout = open(os.devnull, "w")
    mesh = mesh_lib.build(sizes, dcn=dcn)
    workdir = Path(args.workdir or Path("runs") / Path(args.config).stem)
    t0 = time.perf_counter()
    records = run(cfg, mesh, workdir, Path(args.config).stem, stop_at=args.steps, fresh=args.fresh,
                  resume_from=args.resume_from, allow_mismatch=args.allow_mismatch)
    if records:
      skipped = sum(r["skipped"] for r in records)
      print(f"done: {len(records)} steps ({skipped} skipped) in {time.perf_counter() - t0:.1f}s, "
            f"final loss {records[-1]['loss']:.4f}; metrics in {workdir / 'metrics.jsonl'}")
  except (UserError, RunAborted) as e:
    exit_with(e, prog)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
