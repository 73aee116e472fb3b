"""The CLI end to end, in subprocesses as a user runs it."""

import json

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_sec", "step_time_s", "mfu"}


def test_headline_command_on_64_simulated_devices(run_cli, tmp_path):
  r = run_cli("jaxtrain.train", "--mesh", "dp=8,tp=8", "--steps", "2", "--workdir", "w")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "mesh data=8,tensor=8 on 64 cpu device(s)" in r.stdout
  records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [rec["step"] for rec in records] == [1, 2]
  for rec in records:
    assert REQUIRED <= set(rec), REQUIRED - set(rec)
    assert rec["mfu"] is None  # CPU has no known peak
    assert rec["tokens"] > 0 and rec["loss"] > 0 and rec["step_time_s"] > 0
  saved = json.loads((tmp_path / "w" / "config.json").read_text())  # the resolved config
  assert saved["model"]["d_model"] == 128 and saved["train"]["steps"] == 20  # --steps stops; schedule unchanged


@pytest.mark.parametrize("args, env, words", [
    (["--mesh", "xp=2"], {}, ["unknown mesh axis 'xp'", "data (dp)"]),
    (["--mesh", "dp=0"], {}, ["dp=0", "positive integer"]),
    (["--mesh", "dp=2,dp=2"], {}, ["given twice"]),
    (["--mesh", "dp=-1,tp=-1"], {}, ["more than one -1"]),
    (["--mesh", "dp=8"], {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, ["needs 8 devices but 4 are available"]),
    (["--set", "train.batchsize=4"], {}, ["unknown config key 'train.batchsize'", "batch_size"]),
    (["--set", "model.dtype=int8"], {}, ["model.dtype='int8'", "bfloat16, float16, float32"]),
    (["--set", "train.seq_len=long"], {}, ["train.seq_len='long'", "not an integer"]),
    (["--config", "nope"], {}, ["unknown config 'nope'", "tiny"]),
    (["--steps", "0"], {}, ["--steps 0"]),
    (["--mesh", "dp=3"], {}, ["divide over data*fsdp*expert=3"]),
    (["--bogus"], {}, ["unrecognized arguments: --bogus"]),
])
def test_bad_input_gives_one_line_and_nonzero_exit(run_cli, args, env, words):
  r = run_cli("jaxtrain.train", *args, "--workdir", "w", env=env)
  assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxtrain"), r.stderr
  for w in words:
    assert w in lines[0]


def test_help_config_lists_keys(run_cli):
  r = run_cli("jaxtrain.train", "--help-config")
  assert r.returncode == 0
  assert "train.microbatches (int, default 1)" in r.stdout and "model.dtype (one of bfloat16, float16, float32" in r.stdout


@pytest.mark.parametrize("setting, words", [
    ("model.attention=cudnn", "model.attention=cudnn is not supported here: backend is cpu"),
    ("run.profile_steps=7-5", "run.profile_steps='7-5'"),
    ("run.xla_flags_extra=xla_no_dashes", "run.xla_flags_extra: xla_no_dashes is not a flag"),
])
def test_bad_attention_profile_or_flag_setting_is_one_line(run_cli, setting, words):
  r = run_cli("jaxtrain.train", "--mesh", "dp=2", "--steps", "1", "--workdir", "w", "--set", setting,
              "--set", "train.batch_size=4", "--set", "train.seq_len=32")
  assert r.returncode == 2, (r.stdout, r.stderr)
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and words in lines[0], r.stderr


def test_scanned_layers_train_shard_and_resume(run_cli, tmp_path):
  args = ["--mesh", "fsdp=2,tp=2", "--workdir", "w", "--set", "model.scan_layers=true", "--set", "train.batch_size=4",
          "--set", "train.seq_len=32", "--set", "checkpoint.interval=2", "--set", "train.tensorboard=false"]
  r = run_cli("jaxtrain.train", *args, "--steps", "2")
  assert r.returncode == 0, r.stderr[-2000:]
  r = run_cli("jaxtrain.train", *args, "--steps", "3")
  assert r.returncode == 0, r.stderr[-2000:]
  assert "resumed from" in r.stdout and "at step 2" in r.stdout
  records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [rec["step"] for rec in records] == [1, 2, 3] and all(np.isfinite(rec["loss"]) for rec in records)
  assert not (tmp_path / "w" / "tb").exists()


def test_huge_sequence_stops_before_allocating_with_one_line(run_cli, tmp_path):
  r = run_cli("jaxtrain.train", "--mesh", "dp=1", "--set", "train.seq_len=10000000", "--workdir", "w")
  assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and "does not fit: needs" in lines[0] and "GiB available (host memory" in lines[0], r.stderr
  assert "largest items activations" in lines[0] and "run.fit_check=false" in lines[0]
  assert not (tmp_path / "w").exists()  # stopped before the workdir, let alone an array
