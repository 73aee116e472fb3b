"""Experiment trackers besides TensorBoard (run.trackers): Weights & Biases and MLflow, on process 0.

Each gets the scalars TensorBoard gets (metrics.scalars of every record, the goodput summary at the end), the resolved
config and the plan line. A training job is one tracker run: its id is kept in <workdir>/trackers.json and a resume
from a checkpoint continues it; a start from step 0 (first start, --fresh, no committed checkpoint) begins a new one,
as metrics.jsonl begins anew. A tracker that cannot start (package missing, server unreachable, no credentials) is one
warning line and the run goes on without it."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from jaxtrain.core import files
from jaxtrain.run import metrics

IDS_FILE = "trackers.json"
PROJECT = "jaxtrain"  # the W&B project and MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME say


def _read_ids(workdir: Path) -> dict:
  try:
    ids = json.loads((workdir / IDS_FILE).read_text())
  except (OSError, ValueError):  # none yet, or unreadable: a new tracker run
    return {}
  return ids if isinstance(ids, dict) else {}


def _keep_id(workdir: Path, tracker: str, entry: dict) -> None:
  ids = _read_ids(workdir)
  ids[tracker] = entry
  files.write_json_atomic(workdir / IDS_FILE, ids, indent=2)


def _flat(config: dict) -> dict[str, str]:
  return {f"{section}.{k}": str(v) for section, table in config.items() for k, v in table.items()}


class WandbSink(metrics.Tracker):
  """A W&B run; the step is a logged field and every metric's x-axis, so steps a resume recomputes are logged again
  (W&B's own step only grows)."""
  label = "W&B logging"

  def __init__(self, workdir: Path, config: dict, plan: str, resumed: bool):
    import wandb
    stored = _read_ids(workdir).get("wandb", {}).get("id") if resumed else None
    self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, name=workdir.name,
                          dir=os.environ.get("WANDB_DIR") or str(workdir), id=stored,
                          resume="allow" if stored else None, config={**config, "plan": plan},
                          settings=wandb.Settings(silent=True, console="off"))
    if stored:
      self.run.config.update({**config, "plan": plan}, allow_val_change=True)  # free keys may change on resume
    self.run.define_metric("*", step_metric="step")
    _keep_id(workdir, "wandb", {"id": self.run.id, "project": self.run.project})

  def _log(self, step: int, values: dict[str, float]) -> None:
    self.run.log({**values, "step": step})

  def close(self, failed: bool = False) -> None:
    if not self.closed:
      self.closed = True
      with contextlib.suppress(Exception):  # already said, or nothing more to say: the run's end stands
        self.run.finish(exit_code=1 if failed else 0)


class MlflowSink(metrics.Tracker):
  """An MLflow run: the config as params (at its start; MLflow's params cannot change) and as config.json (rewritten
  at each resume), the plan line as the tag jaxtrain.plan."""
  label = "MLflow logging"

  def __init__(self, workdir: Path, config: dict, plan: str, resumed: bool):
    from mlflow import MlflowClient
    self.client = MlflowClient()  # MLFLOW_TRACKING_URI, as MLflow reads it
    stored = _read_ids(workdir).get("mlflow", {}).get("run_id") if resumed else None
    if stored:
      self.run_id = stored
      self.client.update_run(stored, status="RUNNING")
    else:
      name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
      exp = self.client.get_experiment_by_name(name)
      exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
      self.run_id = self.client.create_run(exp_id, run_name=workdir.name).info.run_id
      self.client.log_batch(self.run_id, params=self._params(config))
    self.client.log_dict(self.run_id, config, "config.json")
    self.client.set_tag(self.run_id, "jaxtrain.plan", plan)
    _keep_id(workdir, "mlflow", {"run_id": self.run_id, "tracking_uri": self.client.tracking_uri})

  @staticmethod
  def _params(config: dict) -> list:
    from mlflow.entities import Param
    return [Param(k, v) for k, v in _flat(config).items()]

  def _log(self, step: int, values: dict[str, float]) -> None:
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

  def close(self, failed: bool = False) -> None:
    if not self.closed:
      self.closed = True
      with contextlib.suppress(Exception):  # already said, or nothing more to say: the run's end stands
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


_KINDS = {"wandb": ("wandb", WandbSink), "mlflow": ("mlflow", MlflowSink)}


def open_trackers(names: list[str], workdir: Path, config: dict, plan: str, resumed: bool) -> list:
  """The sinks of `names` (wandb, mlflow) that start; each that does not is one warning line."""
  sinks = []
  for name in names:
    package, kind = _KINDS[name]
    try:
      sinks.append(kind(workdir, config, plan, resumed))
    except ImportError:
      print(f"jaxtrain: warning: run.trackers names {name} but the {package} package is not installed (pip install "
            f"'jaxtrain[trackers]'); training without it", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 (any failure of a tracker's own library: the run goes on without it)
      print(f"jaxtrain: warning: {name} tracker did not start ({metrics.one_line(e)}); training without it",
            file=sys.stderr, flush=True)
  return sinks
