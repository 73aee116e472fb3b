"""run.trackers: W&B (offline) and MLflow (local file store) runs read back through their own formats and APIs,
against metrics.jsonl; one tracker run across a resume; a tracker that cannot start is one warning line."""

import json
import struct
import sys
from pathlib import Path

import pytest

from jaxtrain.core import config
from jaxtrain.run import loop
from tests.helpers import mesh_of

SETS = ["model.dtype=float32", "model.n_layers=1", "train.batch_size=4", "train.seq_len=32", "train.steps=4",
        "checkpoint.interval=2", "checkpoint.async_save=false"]


def _wandb_records(path: Path) -> list:
  """The protobuf records of an offline run's .wandb file (LevelDB's log format behind W&B's 7-byte header), parsed
  with W&B's own record type."""
  from wandb.proto import wandb_internal_pb2 as pb
  data, block = path.read_bytes(), 32768
  assert data[:4] == b":W&B"
  i, out, buf = 7, [], b""
  while i + 7 <= len(data):
    if block - i % block < 7:  # a block's tail too short for a chunk header is padding
      i += block - i % block
      continue
    n, kind = struct.unpack_from("<HB", data, i + 4)
    buf += data[i + 7:i + 7 + n]
    i += 7 + n
    if kind in (1, 4):  # FULL or LAST chunk: a whole record
      rec = pb.Record()
      rec.ParseFromString(buf)
      out.append(rec)
      buf = b""
  return out


def _items(update) -> dict:
  return {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in update}


def _wandb_run(root: Path) -> tuple[set, list[dict], dict]:
  """(run ids, history rows, config) of every offline run file under `root`, in the order written."""
  ids, rows, cfg = set(), [], {}
  for f in sorted(root.rglob("run-*.wandb")):
    for rec in _wandb_records(f):
      kind = rec.WhichOneof("record_type")
      if kind == "run":
        ids.add(rec.run.run_id)
        cfg.update(_items(rec.run.config.update))
      elif kind == "config":
        cfg.update(_items(rec.config.update))
      elif kind == "history":
        rows.append(_items(rec.history.item))
  return ids, rows, cfg


def _scalars(rec: dict) -> dict:
  return {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.mark.slow
def test_wandb_and_mlflow_runs_hold_what_metrics_jsonl_holds_across_a_resume(tmp_path, monkeypatch, capsys):
  from mlflow import MlflowClient
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
  monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  (tmp_path / "wandb").mkdir()
  w = tmp_path / "w"
  cfg = config.load("tiny", [*SETS, "run.trackers=wandb,mlflow"])
  loop.run(cfg, mesh_of("dp=1"), w, "tiny", stop_at=2)
  first = json.loads((w / "trackers.json").read_text())
  loop.run(cfg, mesh_of("dp=1"), w, "tiny")  # resumes at step 2
  out = capsys.readouterr()
  assert "resumed from" in out.out and "warning" not in out.err, out.err
  plan = next(line for line in out.out.splitlines() if line.startswith("attention: "))
  records = [json.loads(line) for line in (w / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  ids = json.loads((w / "trackers.json").read_text())
  assert ids == first  # the resume continued both runs
  resolved = json.loads((w / "config.json").read_text())
  assert not (w / "tb").exists()  # tensorboard not named

  wandb_ids, rows, wandb_cfg = _wandb_run(tmp_path / "wandb")
  assert wandb_ids == {ids["wandb"]["id"]}
  assert len(list((tmp_path / "wandb").rglob("run-*.wandb"))) == 2  # one file per start, one run id
  steps = [r for r in rows if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3, 4]
  for row, rec in zip(steps, records):
    assert {k: row[k] for k in _scalars(rec)} == pytest.approx(_scalars(rec), rel=1e-12)
  assert any("goodput" in r for r in rows)  # the job's summary, as TensorBoard gets it
  assert wandb_cfg["plan"] == plan and wandb_cfg["model"] == resolved["model"] and wandb_cfg["run"] == resolved["run"]

  client = MlflowClient()
  (run,) = client.search_runs([client.get_experiment_by_name("jaxtrain").experiment_id])
  assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
  for key in _scalars(records[0]):
    history = {m.step: m.value for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                key=lambda m: m.timestamp)}
    assert history == pytest.approx({r["step"]: r[key] for r in records}, rel=1e-12), key
  assert "goodput" in run.data.metrics
  assert run.data.tags["jaxtrain.plan"] == plan
  assert run.data.params["optim.lr"] == str(resolved["optim"]["lr"])
  assert run.data.params["run.trackers"] == "wandb,mlflow"
  stored = json.loads(Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))).read_text())
  assert stored == resolved


@pytest.mark.slow
def test_a_tracker_that_cannot_start_is_one_warning_line_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: its import fails
  monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
  monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
  monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
  w = tmp_path / "w"
  loop.run(config.load("tiny", [*SETS, "run.trackers=tensorboard,wandb,mlflow"]), mesh_of("dp=1"), w, "tiny")
  err = capsys.readouterr().err
  warnings = [line for line in err.splitlines() if "warning" in line]
  assert len(warnings) == 2, err
  assert "run.trackers names wandb but the wandb package is not installed" in warnings[0]
  assert warnings[1].startswith("jaxtrain: warning: mlflow tracker did not start (")
  assert "Traceback" not in err
  assert [json.loads(line)["step"] for line in (w / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
  assert list((w / "tb").glob("events.out.tfevents.*"))  # the tracker that could start still writes


def test_mlflow_run_id_kept_for_resumes_new_from_step_0_and_a_later_failure_is_one_line(tmp_path, monkeypatch,
                                                                                           capsys):
  import shutil

  from mlflow import MlflowClient

  from jaxtrain.run import trackers
  monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp")
  w = tmp_path / "w"
  w.mkdir()
  cfg = {"optim": {"lr": 0.5}}
  first = trackers.MlflowSink(w, cfg, "plan", resumed=False)
  first.write(1, {"step": 1, "loss": 2.0, "skipped": False, "mfu": None, "eval_loss": float("nan")})
  first.close()
  again = trackers.MlflowSink(w, {"optim": {"lr": 0.25}}, "plan 2", resumed=True)  # a resume: the same run
  again.write(2, {"step": 2, "loss": 1.5})
  again.close()
  assert again.run_id == first.run_id == json.loads((w / "trackers.json").read_text())["mlflow"]["run_id"]
  client = MlflowClient()
  run = client.get_run(first.run_id)
  assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "loss")] == [(1, 2.0), (2, 1.5)]
  assert set(run.data.metrics) == {"step", "loss"}  # None, booleans and non-finite numbers are not scalars
  assert run.data.params == {"optim.lr": "0.5"} and run.data.tags["jaxtrain.plan"] == "plan 2"
  fresh = trackers.MlflowSink(w, cfg, "plan", resumed=False)  # step 0 (--fresh, no checkpoint): a new run
  assert fresh.run_id != first.run_id
  assert json.loads((w / "trackers.json").read_text())["mlflow"]["run_id"] == fresh.run_id
  assert client.get_experiment_by_name("exp").experiment_id == run.info.experiment_id
  shutil.rmtree(tmp_path / "mlruns")  # the store goes away mid-run
  fresh.write(3, {"loss": 1.0})
  fresh.write(4, {"loss": 0.5})
  fresh.close()
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxtrain: warning: MLflow logging stops at step 3: "), lines
