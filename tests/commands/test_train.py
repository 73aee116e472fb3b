"""The CLI end to end, in subprocesses as a user runs it."""

import json

import pytest

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
