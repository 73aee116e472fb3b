"""The one output-path check (jaxtrain/core/outputs.py) on directories laid out as the commands leave them: which
paths are refused, which are a command's own to write. The commands themselves: tests/commands/test_data_safety.py."""

import json

import pytest

from jaxtrain.core import outputs
from jaxtrain.core.errors import UserError


@pytest.fixture
def disk(tmp_path):
  run = tmp_path / "run"
  (run / "checkpoints" / "2" / "default").mkdir(parents=True)
  (run / "checkpoints" / "2" / "manifest.json").write_text(json.dumps({"format": 1, "step": 2}))
  (run / "metrics.jsonl").write_text('{"step": 1}\n')
  (run / "config.json").write_text("{}")
  data = tmp_path / "data"
  data.mkdir()
  (data / "manifest.json").write_text(json.dumps({"format": outputs.DATASET_FORMAT}))
  half = tmp_path / "half"  # a prepare still running: no manifest yet
  half.mkdir()
  (half / "prepare.json").write_text("{}")
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text("{}")
  (hf / "model.safetensors").write_bytes(b"")
  export = tmp_path / "export"
  export.mkdir()
  for f in ("config.json", "model-00001-of-00001.safetensors", outputs.EXPORT_RECORD):
    (export / f).write_text("{}")
  (tmp_path / "corpus.txt").write_text("x")
  (tmp_path / "empty").mkdir()
  return tmp_path


REFUSED = [
    ("run/metrics.jsonl", "file", [], "a file of the run"),
    ("run/config.json", "file", [], "a file of the run"),
    ("run/metrics.resumed.20260101T000000Z.jsonl", "file", [], "a file of the run"),
    ("run/checkpoints/2", "dir", [], "a file of the run"),
    ("run/checkpoints/2/", "dataset", [], "a file of the run"),
    ("run/checkpoints/../checkpoints/9", "workdir", [], "a file of the run"),
    ("run", "export", [], "is a run directory"),
    ("run", "dataset", [], "is a run directory"),
    ("data", "export", [], "prepared dataset"),
    ("data", "workdir", [], "prepared dataset"),
    ("data/sub", "dataset", [], "prepared dataset"),
    ("half/bench.json", "file", [], "prepared dataset"),
    ("hf", "export", [], "not one `hf export` wrote"),
    ("hf", "workdir", [], "Hugging Face model"),
    ("hf/config.json", "file", [], "Hugging Face model"),
    ("corpus.txt", "file", ["corpus.txt"], "which this command reads"),
    (".", "dataset", ["corpus.txt"], "holds"),
    ("run", "file", [], "is a run directory"),
    ("empty", "file", [], "is a directory"),
]


@pytest.mark.parametrize("path,kind,sources,words", REFUSED)
def test_refused(disk, monkeypatch, path, kind, sources, words):
  monkeypatch.chdir(disk)
  with pytest.raises(UserError, match="--out") as e:
    outputs.check(path, "--out", kind, sources)
  assert words in str(e.value) and "\n" not in str(e.value)


ALLOWED = [
    ("run", "workdir"),  # train resumes its own run
    ("run/bench.json", "file"),  # bench's default output
    ("run/hf-out", "export"),  # docs/huggingface.md's example: beside the run's files
    ("data", "dataset"),  # prepare resumes its own dataset
    ("export", "export"),  # an export rerun
    ("new/deeper", "dir"),
]


@pytest.mark.parametrize("path,kind", ALLOWED)
def test_allowed(disk, monkeypatch, path, kind):
  monkeypatch.chdir(disk)
  outputs.check(path, "--out", kind, ["corpus.txt"])


def test_a_symlink_is_judged_by_what_it_points_to(disk, monkeypatch):
  monkeypatch.chdir(disk)
  (disk / "link").symlink_to(disk / "run" / "metrics.jsonl")
  with pytest.raises(UserError, match="a file of the run"):
    outputs.check("link", "--out", "file")
