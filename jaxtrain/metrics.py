"""Per-step metrics records and the sinks that receive them (metrics.jsonl, console, TensorBoard).

A record is built once per step (`record`) and handed to every sink's `write(step, record)`.
Only process 0 has sinks. metrics.jsonl is strict JSON: a non-finite number is written as
null (the `skipped` flag says why).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from jaxtrain.errors import UserError

MOE_FIELDS = ("moe_aux_loss", "moe_dropped_frac")
EVAL_FIELDS = ("eval_loss", "eval_ppl")


def record(step: int, fetched: dict, step_time: float, data_wait: float, progress, flops_per_step: float,
           peak_total: float | None) -> dict:
  """One metrics.jsonl record from a step's fetched device metrics and the run state after it."""
  m = {k: v.item() for k, v in fetched.items()}
  tokens = int(m["tokens"])
  rec = {
      "step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"], "tokens": tokens,
      "tokens_per_sec": tokens / step_time, "step_time_s": step_time, "data_wait_s": data_wait,
      "mfu": flops_per_step / step_time / peak_total if peak_total else None,
      "skipped": bool(m["skipped"]), "loss_scale": m["loss_scale"],
      "tokens_seen": progress.tokens_seen, "tokens_updated": progress.tokens_updated,
  }
  rec.update({k: m[k] for k in (*EVAL_FIELDS, *MOE_FIELDS) if k in m})  # eval steps / MoE models only
  return rec


def strict(rec: dict) -> dict:
  """The record with non-finite floats as None, so strict JSON parsers read it."""
  return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}


def read_records(path: Path) -> list[dict]:
  """The records of a metrics.jsonl. A torn final line (the process died mid-write) is dropped
  with a note; any other unreadable line is a one-line error naming the file and line."""
  text = path.read_text()
  lines = text.splitlines()
  out = []
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError as e:
      if i == len(lines) and not text.endswith("\n"):
        print(f"metrics: dropping the torn last line {i} of {path} (the run stopped while writing it)")
        continue
      raise UserError(f"{path}:{i} is not a JSON record ({e.msg}); fix or move the file aside") from None
  return out


class JsonlSink:
  """<workdir>/metrics.jsonl, one record per line. A fresh run keeps an old file aside; a
  resumed run drops the records past its checkpoint (they will be recomputed), keeping the
  full old file aside, so nothing is lost."""

  def __init__(self, path: Path, resumed_at: int | None):
    self.path = path
    if path.exists():
      backup = path.with_name(f"metrics.{int(time.time())}.jsonl")
      if resumed_at is None:
        path.rename(backup)
        print(f"previous {path.name} kept as {backup.name}")
      else:
        text = path.read_text()
        records = read_records(path)
        kept = [r for r in records if r.get("step", 0) <= resumed_at]
        if len(kept) != len(records) or (text and not text.endswith("\n")):
          path.rename(backup)
          path.write_text("".join(json.dumps(strict(r)) + "\n" for r in kept))
          print(f"metrics: {len(records) - len(kept)} record(s) after step {resumed_at} will be recomputed "
                f"(old file kept as {backup.name})")
    self.file = path.open("a", buffering=1)

  def write(self, step: int, rec: dict) -> None:
    self.file.write(json.dumps(strict(rec), allow_nan=False) + "\n")

  def close(self) -> None:
    self.file.close()


class ConsoleSink:
  """A progress line every `log_every` steps and at the last one."""

  def __init__(self, total: int, log_every: int):
    self.total, self.log_every = total, log_every

  def write(self, step: int, rec: dict) -> None:
    if step % self.log_every and step != self.total:
      return
    mfu = f"{rec['mfu']:.1%}" if rec["mfu"] is not None else "n/a"
    print(f"step {step:>6}/{self.total}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  gnorm {rec['grad_norm']:.3f}  "
          f"tok/s {rec['tokens_per_sec']:,.0f}  step {rec['step_time_s'] * 1e3:.0f}ms  "
          f"data {rec['data_wait_s'] * 1e3:.1f}ms  mfu {mfu}"
          + (f"  scale {rec['loss_scale']:g}" if rec["loss_scale"] != 1.0 else "")
          + ("  SKIPPED (non-finite gradients)" if rec["skipped"] else "")
          + (f"  eval {rec['eval_loss']:.4f} (ppl {rec['eval_ppl']:.2f})" if "eval_loss" in rec else ""), flush=True)

  def close(self) -> None:
    pass


class TensorBoardSink:
  """The numeric fields of each record (not None or booleans) as scalars of the same name,
  in <workdir>/tb/ (tensorboardX writes the event files)."""

  def __init__(self, logdir: Path):
    from tensorboardX import SummaryWriter
    self.writer = SummaryWriter(logdir=str(logdir), flush_secs=10)

  def write(self, step: int, rec: dict) -> None:
    for k, v in rec.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        self.writer.add_scalar(k, v, step)

  def close(self) -> None:
    self.writer.close()


class Sinks:
  def __init__(self, sinks: list):
    self.sinks = sinks

  def write(self, step: int, rec: dict) -> None:
    for s in self.sinks:
      s.write(step, rec)

  def close(self) -> None:
    for s in self.sinks:
      s.close()
