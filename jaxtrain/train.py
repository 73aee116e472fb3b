"""`python -m jaxtrain.train`: train a transformer on a device mesh.

    python -m jaxtrain.train --mesh dp=8,tp=8 [--config tiny] [--set train.lr=1e-3] [--steps N] [--workdir DIR]

Writes one JSON record per optimizer step to <workdir>/metrics.jsonl and a progress line
to the console. Metrics are fetched one step late so the host never stalls the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxtrain.errors import RunAborted, UserError, exit_with


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
  p.add_argument("--steps", type=int, help="total optimizer steps (overrides train.steps)")
  p.add_argument("--workdir", help="where metrics.jsonl and config.json go (default: runs/<config name>)")
  p.add_argument("--help-config", action="store_true", help="list every config key with type, default and meaning")
  return p.parse_args(argv)


class MetricsLog:
  """Turns fetched step metrics into metrics.jsonl records and console lines, and keeps
  the host-side clocks: `tokens_seen` (valid tokens consumed) and `tokens_updated`
  (valid tokens of steps that moved the params). Python ints, so they never overflow."""

  def __init__(self, path: Path, setup, total_steps: int, log_every: int):
    import jax
    from jaxtrain import flops
    cfg = setup.cfg
    if path.exists():
      moved = path.with_name(f"metrics.{int(path.stat().st_mtime)}.jsonl")
      path.rename(moved)
      print(f"previous {path.name} kept as {moved.name}")
    self.file = path.open("a", buffering=1)
    self.total, self.log_every = total_steps, log_every
    self.flops_per_step = flops.flops_per_token(cfg.model, cfg.train.seq_len) * cfg.train.batch_size * cfg.train.seq_len
    peak = flops.peak_flops(setup.mesh.devices.flat[0].device_kind)
    self.peak_total = peak * setup.mesh.size if peak else None
    self.tokens_seen = self.tokens_updated = self.skipped_total = self.skipped_in_a_row = 0
    self.max_skipped = cfg.train.max_skipped_in_a_row
    self._jax = jax

  def write(self, step: int, fetched: dict, step_time: float, data_wait: float) -> dict:
    m = {k: v.item() for k, v in fetched.items()}
    tokens, skipped = int(m["tokens"]), bool(m["skipped"])
    self.tokens_seen += tokens
    self.tokens_updated += 0 if skipped else tokens
    self.skipped_total += skipped
    self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
    rec = {
        "step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"], "tokens": tokens,
        "tokens_per_sec": tokens / step_time, "step_time_s": step_time, "data_wait_s": data_wait,
        "mfu": self.flops_per_step / step_time / self.peak_total if self.peak_total else None,
        "skipped": skipped, "loss_scale": m["loss_scale"],
        "tokens_seen": self.tokens_seen, "tokens_updated": self.tokens_updated,
    }
    rec.update({k: m[k] for k in ("moe_aux_loss", "moe_dropped_frac") if k in m})  # MoE models only
    self.file.write(json.dumps(rec) + "\n")
    if step % self.log_every == 0 or step == self.total:
      mfu = f"{rec['mfu']:.1%}" if rec["mfu"] is not None else "n/a"
      print(f"step {step:>6}/{self.total}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  gnorm {rec['grad_norm']:.3f}  "
            f"tok/s {rec['tokens_per_sec']:,.0f}  step {step_time * 1e3:.0f}ms  data {data_wait * 1e3:.1f}ms  mfu {mfu}"
            + (f"  scale {rec['loss_scale']:g}" if rec["loss_scale"] != 1.0 else "")
            + ("  SKIPPED (non-finite gradients)" if skipped else ""), flush=True)
    if self.skipped_in_a_row >= self.max_skipped:
      raise RunAborted(f"aborting at step {step}: {self.skipped_in_a_row} steps in a row (steps "
                       f"{step - self.skipped_in_a_row + 1}-{step}) had non-finite gradients or no valid token "
                       f"(train.max_skipped_in_a_row={self.max_skipped}); loss scale {rec['loss_scale']:g}")
    return rec

  def close(self):
    self.file.close()


def run(cfg, mesh, workdir: Path, config_name: str) -> list[dict]:
  """Trains cfg.train.steps steps on `mesh`; returns the metrics records."""
  import jax
  from jaxtrain import data, mesh as mesh_lib, step as step_lib

  setup = step_lib.Setup(cfg, mesh)
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
  dev = mesh.devices.flat[0]
  print(f"jaxtrain: {config_name} ({setup.n_params:,} params), mesh {mesh_lib.describe(dict(mesh.shape))} "
        f"on {mesh.size} {dev.platform} device(s) [{dev.device_kind}], workdir {workdir}")
  if setup.notes:
    print(f"sharding: {len(setup.notes)} dimension(s) replicated where the mesh axis does not divide them, e.g. "
          f"{setup.notes[0]}")

  batches = data.batches(cfg, jax.process_index(), jax.process_count())
  log = MetricsLog(workdir / "metrics.jsonl", setup, cfg.train.steps, cfg.train.log_every)
  try:
    t0 = time.perf_counter()
    state = setup.init()
    first = setup.device_batch(next(batches))
    compiled = setup.step.lower(state, first).compile()
    print(f"initialized and compiled in {time.perf_counter() - t0:.1f}s", flush=True)

    records, pending = [], None

    def log_step(step, metrics, wait, since):
      fetched = jax.device_get(metrics)  # blocks until that step is done
      done = time.perf_counter()
      records.append(log.write(step, fetched, done - since, wait))
      return done

    batch, wait = first, 0.0
    last_done = time.perf_counter()
    for s in range(1, cfg.train.steps + 1):
      state, metrics = compiled(state, batch)
      if pending:  # step s-1's metrics: reading them waits for s-1, while s is already queued
        last_done = log_step(*pending, last_done)
      pending = (s, metrics, wait)
      if s < cfg.train.steps:
        t = time.perf_counter()
        batch = setup.device_batch(next(batches))
        wait = time.perf_counter() - t
    log_step(*pending, last_done)
    return records
  finally:
    log.close()
    batches.close()


def main(argv=None) -> int:
  args = parse_args(argv)
  from jaxtrain import config, mesh as mesh_lib
  if args.help_config:
    print(config.help_text())
    return 0
  try:
    if args.steps is not None and args.steps < 1:
      raise UserError(f"--steps {args.steps}: must be a positive integer")
    cfg = config.load(args.config, args.set, args.steps)
    mesh = mesh_lib.setup(args.mesh)
    workdir = Path(args.workdir or Path("runs") / Path(args.config).stem)
    t0 = time.perf_counter()
    records = run(cfg, mesh, workdir, Path(args.config).stem)
    skipped = sum(r["skipped"] for r in records)
    print(f"done: {len(records)} steps ({skipped} skipped) in {time.perf_counter() - t0:.1f}s, "
          f"final loss {records[-1]['loss']:.4f}; metrics in {workdir / 'metrics.jsonl'}")
  except (UserError, RunAborted) as e:
    exit_with(e)
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
