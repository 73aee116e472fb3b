"""train.eval_tasks: lm-eval tasks every train.eval_tasks_interval steps in the training process, on its mesh, with
the live parameters; checked against `python -m jaxtrain.eval` on the checkpoint of the same step (the command's
own path: parameters restored from disk onto the compute layout)."""

import json

import pytest

from jaxtrain import eval as eval_command, train as train_command
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.interop import tasks as tasks_lib
from jaxtrain.run import loop
from tests.helpers import mesh_of
from tests.hf_models import tokenizer_json
from tests.interop.test_harness import _tasks

ROLL = [{"text": "the quick brown fox jumps over the lazy dog"}, {"text": "hello world, tiny models"}]


def _local_tasks(d):
  """tiny_mc (multiple choice: acc) and tiny_gen of the harness tests, and tiny_roll (whole-text log-likelihoods:
  perplexities and bits per byte, continuous in them)."""
  path = _tasks(d)
  (d / "tiny_roll.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROLL))
  (d / "tiny_roll.yaml").write_text(
      f"task: tiny_roll\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'tiny_roll'}.jsonl\n"
      'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
      "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
  return path


def _cfg(tmp, include, *extra):
  return config.load("tiny", ["model.dtype=float32", "model.n_layers=1", "train.batch_size=4", "train.seq_len=32",
                              f"data.tokenizer={tmp / 'tok.json'}", "run.trackers=mlflow", "optim.lr=1e-2",
                              "train.eval_tasks=tiny_mc,tiny_roll", "train.eval_tasks_interval=2",
                              f"train.eval_include_path={include}", "checkpoint.interval=2", "checkpoint.keep=10",
                              *extra])


@pytest.mark.slow  # lm-eval's import and task index, a short run, the eval command in-process
def test_tasks_every_n_steps_equal_the_eval_command_on_that_steps_checkpoint(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
  tokenizer_json(tmp_path / "tok.json")
  include = _local_tasks(tmp_path / "tasks")
  w = tmp_path / "w"
  # an unknown name: one line, exit 2, before anything is written (the command's start-up included)
  with pytest.raises(SystemExit) as e:
    train_command.main(["--config", "tiny", "--workdir", str(w), "--set", "train.eval_tasks=tiny_mc,tiny_nope",
                        "--set", "train.eval_tasks_interval=1", "--set", f"train.eval_include_path={include}",
                        "--set", f"data.tokenizer={tmp_path / 'tok.json'}", "--set", "run.trackers="])
  err = capsys.readouterr().err
  assert e.value.code == 2 and not w.exists(), err
  assert err.strip() == ("jaxtrain: error: train.eval_tasks: unknown task 'tiny_nope' (not among lm-eval's "
                         "tasks nor those of train.eval_include_path)")
  # ZeRO-1 on dp=2: the stored master is split over data, the harness scores with the step's compute copy
  cfg = _cfg(tmp_path, include, "optim.zero_stage=1")
  seen = []  # (the parameters the step passed on, those the harness scored with)
  real_evaluate, real_log = tasks_lib.evaluate, loop._Steps.log_step  # noqa: SLF001

  def log_step(self, s, m, wait, since, params=None):
    if params is not None:
      seen.append([params])
    return real_log(self, s, m, wait, since, params)

  def evaluate(lm, names, manager, limit):
    seen[-1].append(lm.params)
    return real_evaluate(lm, names, manager, limit)
  monkeypatch.setattr(loop._Steps, "log_step", log_step)  # noqa: SLF001
  monkeypatch.setattr(tasks_lib, "evaluate", evaluate)
  loop.run(cfg, mesh_of("dp=2"), w, "tiny", stop_at=4)
  # no copy: the harness got the train state's own arrays at each eval step
  assert len(seen) == 2 and all(len(pair) == 2 for pair in seen)
  import jax
  for live, scored in seen:
    assert all(a is b for a, b in zip(jax.tree.leaves(live), jax.tree.leaves(scored), strict=True))
  recs = [json.loads(line) for line in (w / "metrics.jsonl").read_text().splitlines()]
  logged = {r["step"]: {k: v for k, v in r.items() if k.startswith("lm_eval/")} for r in recs}
  assert not logged[1] and not logged[3] and logged[2].keys() == logged[4].keys()
  assert {"lm_eval/tiny_mc/acc", "lm_eval/tiny_roll/word_perplexity", "lm_eval/tiny_roll/bits_per_byte"} <= set(
      logged[2])
  assert logged[2] != logged[4]  # the parameters moved between the two evaluations
  # the math is unchanged: the same run without the tasks has the same losses and gradient norms, bit for bit
  loop.run(_cfg(tmp_path, include, "optim.zero_stage=1", "train.eval_tasks_interval=0"), mesh_of("dp=2"),
           tmp_path / "plain", "tiny", stop_at=4)
  plain = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
  assert [(r["loss"], r["grad_norm"]) for r in plain] == [(r["loss"], r["grad_norm"]) for r in recs]
  from mlflow import MlflowClient  # the tracker got them as it gets eval_loss, read back through its own API
  client = MlflowClient()
  run_id = json.loads((w / "trackers.json").read_text())["mlflow"]["run_id"]
  for key in logged[2]:
    assert {m.step: m.value for m in client.get_metric_history(run_id, key)} == pytest.approx(
        {2: logged[2][key], 4: logged[4][key]}, rel=1e-12), key
  out = capsys.readouterr().out
  assert "tiny_mc/acc" in next(line for line in out.splitlines() if line.startswith("step      2/4"))
  during = json.loads((w / "eval" / "step_2.json").read_text())
  # the independent path: the eval command on step 2's checkpoint (it rewrites eval/step_2.json)
  assert eval_command.main(["--workdir", str(w), "--step", "2", "--tasks", "tiny_mc,tiny_roll", "--include-path",
                            include, "--mesh", "dp=4,tp=2"]) == 0
  after = json.loads((w / "eval" / "step_2.json").read_text())
  assert during["step"] == after["step"] == 2
  for task in ("tiny_mc", "tiny_roll"):
    for key, want in after["results"][task].items():
      if isinstance(want, float):
        assert during["results"][task][key] == pytest.approx(want, rel=1e-5), (task, key)
  assert logged[2]["lm_eval/tiny_mc/acc"] == after["results"]["tiny_mc"]["acc,none"]
  assert logged[2]["lm_eval/tiny_roll/word_perplexity"] == pytest.approx(
      after["results"]["tiny_roll"]["word_perplexity,none"], rel=1e-5)


def test_eval_tasks_keys_are_checked_with_the_config():
  for sets, words in ((["train.eval_tasks_interval=5"], "train.eval_tasks_interval=5 needs train.eval_tasks"),
                      (["train.eval_tasks=a,,b", "train.eval_tasks_interval=5"], "item 2 of 3 is empty"),
                      (["train.eval_tasks=a", "train.eval_tasks_interval=5", "optim.offload=host"],
                       "optim.offload='host' is not supported yet"),
                      (["train.eval_tasks=a", "train.eval_tasks_interval=5", "model.lora_rank=4",
                        "model.lora_base_dtype=nf4"], "model.lora_base_dtype='nf4' is not supported yet")):
    with pytest.raises(UserError, match=words.replace("(", r"\(")) as e:
      config.load("tiny", sets)
    assert "\n" not in str(e.value)
  # without an interval the tasks run never: reported as ignored, not refused
  cfg = config.load("tiny", ["train.eval_tasks=a"])
  assert any("train.eval_tasks" in line for line in config.ignored(cfg))


def test_task_metrics_are_named_by_task_metric_and_filter():
  import numpy as np
  results = {"results": {"gsm": {"alias": "gsm", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match":
                                 "N/A", "acc,none": np.float32(0.25), "acc_stderr,none": float("nan"),
                                 "sample_len": 3}}}
  assert tasks_lib.scalars(results) == {"lm_eval/gsm/exact_match/strict-match": 0.5, "lm_eval/gsm/acc": 0.25}
