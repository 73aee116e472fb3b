"""Per-step metrics records and their sinks (metrics.jsonl, console, the trackers: TensorBoard here, W&B and MLflow
in run/trackers.py), on process 0 only."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

from jaxtrain.run import runfiles

MOE_FIELDS = ("moe_aux_loss", "moe_dropped_frac", "moe_load_imbalance")
EVAL_FIELDS = ("eval_loss", "eval_ppl")
TASK_PREFIX = "lm_eval/"  # train.eval_tasks's metrics: lm_eval/<task>/<metric> (interop/tasks.py)
DPO_FIELDS = ("dpo_reward_chosen", "dpo_reward_rejected", "dpo_reward_accuracy", "dpo_reward_margin")


def record(step: int, fetched: dict, step_time: float, data_wait: float, progress, flops_per_step: float,
           peak_total: float | None) -> dict:
  """One metrics.jsonl record from a step's fetched device metrics and the run state after it."""
  m = {k: v.item() for k, v in fetched.items() if k != "attn_max_logit"}
  tokens = int(m["tokens"])
  return {
      "step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"], "tokens": tokens,
      "tokens_per_sec": tokens / step_time, "step_time_s": step_time, "data_wait_s": data_wait,
      "mfu": flops_per_step / step_time / peak_total if peak_total else None,
      "skipped": bool(m["skipped"]), "loss_scale": m["loss_scale"],
      "tokens_seen": progress.tokens_seen, "tokens_updated": progress.tokens_updated,
      **{k: m[k] for k in (*EVAL_FIELDS, *MOE_FIELDS, *DPO_FIELDS, "qk_clipped_heads") if k in m},  # eval/MoE/DPO/QK
      **_per_layer("attn_max_logit", fetched.get("attn_max_logit")),
  }


def _per_layer(name: str, values) -> dict:
  """A per-layer array as one scalar per layer (`name`/layerN, what trackers plot) and its largest (`name`)."""
  if values is None:
    return {}
  values = [float(v) for v in values]
  return {name: max(values), **{f"{name}/layer{i}": v for i, v in enumerate(values)}}


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f}"


def _checklist(rec: dict) -> str:
  """Device memory in use/peak (host RSS where the backend keeps no statistics), the loader's headroom and, with
  optim.offload=host, the host link's time per step."""
  out = ""
  if rec.get("device_mem_bytes") is not None:
    out += f"  mem {_gib(rec['device_mem_bytes'])}/{_gib(rec['device_mem_peak_bytes'])}GiB"
  elif rec.get("host_rss_bytes") is not None:
    out += f"  rss {_gib(rec['host_rss_bytes'])}GiB"
  if rec.get("data_rho") is not None:
    out += f"  rho {rec['data_rho']:.1f}"
  if rec.get("offload_link_s") is not None:
    out += f"  link {rec['offload_link_s'] * 1e3:.1f}ms"
  return out


def _tasks(rec: dict, most: int = 4) -> str:
  """train.eval_tasks's metrics at an eval step (stderrs left to the files): the first `most`, then a count."""
  shown = [(k.removeprefix(TASK_PREFIX), v) for k, v in rec.items()
           if k.startswith(TASK_PREFIX) and "_stderr" not in k]
  more = f" +{len(shown) - most} more" if len(shown) > most else ""
  return "".join(f"  {k} {v:.4f}" for k, v in shown[:most]) + more


def skip_reason(rec: dict) -> str:
  """Why a step moved nothing: the step skips one that trained no token or had non-finite gradients."""
  return "no trained token in this step" if rec["tokens"] == 0 else "non-finite gradients"


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
          + _checklist(rec) + (f"  scale {rec['loss_scale']:g}" if rec["loss_scale"] != 1.0 else "")
          + (f"  SKIPPED ({skip_reason(rec)})" if rec["skipped"] else "")
          + (f"  acc {rec['dpo_reward_accuracy']:.2f} margin {rec['dpo_reward_margin']:.3f}"
             if "dpo_reward_margin" in rec else "")
          + (f"  eval {rec['eval_loss']:.4f} (ppl {rec['eval_ppl']:.2f})" if "eval_loss" in rec else "")
          + _tasks(rec), flush=True)

  def close(self) -> None:
    pass


def scalars(rec: dict) -> dict[str, float]:
  """What a tracker plots of a record: its finite numbers (None and bools are not scalars)."""
  return {k: v for k, v in rec.items()
          if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def one_line(err: BaseException) -> str:
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class Tracker:
  """A view of the records besides metrics.jsonl (which decides): a tracker that fails says so in one line and is
  closed, and the run goes on. Subclasses log `scalars` in `_log` and may raise `errors`."""
  label = ""
  errors: tuple[type[BaseException], ...] = (Exception,)
  closed = False

  def write(self, step: int, rec: dict) -> None:
    if self.closed:
      return
    try:
      self._log(step, scalars(rec))
    except self.errors as e:
      print(f"jaxtrain: warning: {self.label} stops at step {step}: {one_line(e)}", file=sys.stderr, flush=True)
      self.close(failed=True)

  def _log(self, step: int, values: dict[str, float]) -> None:
    raise NotImplementedError

  def close(self, failed: bool = False) -> None:
    self.closed = True


class TensorBoardSink(Tracker):
  """The scalars of each record under the same names, in <workdir>/tb/: one event a record, written and flushed in
  the calling thread. (tensorboardX's SummaryWriter queues events for a writer thread; on a full disk that thread
  dies, its bounded queue fills, and the next put blocks the run forever.)"""
  label, errors = "TensorBoard events", (OSError,)  # TensorBoard is a view: losing it must not end the run

  def __init__(self, logdir: Path):
    self.logdir, self.writer = logdir, None
    # imported now, before the steps (seconds where it imports torch): at the first write it was step 2's time
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    self._writer_class, self._event, self._summary = EventsWriter, Event, Summary

  def _log(self, step: int, values: dict[str, float]) -> None:
    if self.writer is None:  # opened with the first record: a run that writes none leaves no events file
      self.logdir.mkdir(parents=True, exist_ok=True)
      self.writer = self._writer_class(str(self.logdir / "events"))
    summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
    self.writer.write_event(self._event(wall_time=time.time(), step=step, summary=summary))
    self.writer.flush()  # a full disk fails here, in this thread, at this step

  def close(self, failed: bool = False) -> None:
    if self.writer is not None:
      with contextlib.suppress(OSError):
        self.writer.close()
    self.writer, self.closed = None, True


class Sinks:
  def __init__(self, sinks: list):
    self.sinks = sinks

  def writer(self) -> runfiles.JsonlWriter | None:
    """metrics.jsonl's writer (its failure state drives the run's stop), or None."""
    return next((s for s in self.sinks if isinstance(s, runfiles.JsonlWriter)), None)

  def write(self, step: int, rec: dict) -> None:
    for s in self.sinks:
      s.write(step, rec)

  def write_only(self, kind: type, step: int, rec: dict) -> None:
    for s in self.sinks:
      if isinstance(s, kind):
        s.write(step, rec)

  def close(self, failed: bool = False) -> None:
    """`failed`: the run ends with an error (a tracker marks its run so)."""
    for s in self.sinks:
      if isinstance(s, Tracker):
        s.close(failed=failed)
      else:
        s.close()
