"""A key that acts not (config.DEPENDENT) is named once and does not tie a resume to it (issue 54, item 8)."""

from jaxtrain.core import config
from jaxtrain.run import loop
from tests.helpers import mesh_of

SETS = ["model.n_layers=1", "train.batch_size=2", "train.seq_len=16", "data.workers=0", "run.tensorboard=false"]


def test_a_resume_without_the_ignored_keys_is_the_same_run(tmp_path, capsys):
  w = tmp_path / "w"
  idle = ["model.lora_alpha=32", "model.lora_targets=q,k", "train.dpo_beta=0.3", "optim.zero_stage=1"]
  loop.run(config.load("tiny", [*SETS, *idle]), mesh_of("dp=1"), w, "tiny", stop_at=1)
  out = capsys.readouterr().out
  assert out.count("ignored: ") == 1
  line = next(line for line in out.splitlines() if line.startswith("ignored: "))
  assert all(k.partition("=")[0] in line for k in idle), line
  loop.run(config.load("tiny", SETS), mesh_of("dp=1"), w, "tiny", stop_at=2)  # before: "model.lora_alpha: 32.0 -> 16.0"
  out = capsys.readouterr().out
  assert "at step 1" in out and "ignored: " not in out
  loop.run(config.load("tiny", [*SETS, "model.lora_alpha=8"]), mesh_of("dp=1"), w, "tiny", stop_at=3)
  assert "at step 2" in capsys.readouterr().out
