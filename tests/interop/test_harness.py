"""jaxtrain's model in lm-eval-harness (interop/harness.py) against lm-eval's own Hugging Face backend on the same
weights exported with `hf export`: local task YAMLs over local JSONL files (nothing downloaded), float32."""

import json

import numpy as np
import pytest

from jaxtrain.core import config
from jaxtrain.interop import hf_export
from jaxtrain.run import checkpoint, loop, runs
from tests.helpers import mesh_of
from tests.hf_models import tokenizer_json

pytestmark = pytest.mark.slow  # a run trained and exported, two backends evaluated

MC = [{"question": "the quick brown", "choices": [" fox", " dog", " world"], "answer": 0},
      {"question": "hello", "choices": [" world", " fox", " lazy"], "answer": 0},
      {"question": "jumps over the", "choices": [" lazy", " quick", " models"], "answer": 0},
      {"question": "tiny", "choices": [" models", " brown", " hello world"], "answer": 2}]
GEN = [{"question": "the quick", "answer": " brown fox"}, {"question": "hello", "answer": " world"},
       {"question": "over the lazy", "answer": " dog"}]


def _tasks(d):
  d.mkdir()
  for name, rows, body in (
      ("tiny_mc", MC, 'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n'),
      ("tiny_gen", GEN, "output_type: generate_until\ngeneration_kwargs:\n  until: ['.', 'z']\n  max_gen_toks: 6\n"
       "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")):
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / name}.jsonl\n"
        f'test_split: test\ndoc_to_text: "{{{{question}}}}"\ndoc_to_target: "{{{{answer}}}}"\n{body}')
  return str(d)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """(workdir, its HF export) of a 1-layer model trained 3 steps with a BPE tokenizer, float32."""
  tmp = tmp_path_factory.mktemp("harness")
  tokenizer_json(tmp / "tok.json")
  cfg = config.load("tiny", ["model.dtype=float32", "model.n_layers=1", "train.batch_size=4", "train.seq_len=32",
                             f"data.tokenizer={tmp / 'tok.json'}", "run.trackers=", "optim.lr=1e-2"])
  loop.run(cfg, mesh_of("dp=1"), tmp / "w", "tiny", stop_at=3)
  step_dir = runs.locate(tmp / "w", 3)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of("dp=1"), step_dir, tmp / "hf",
                       "float32", 10**9, tmp / "w")
  return tmp


def _jaxtrain_lm(w, spec, batch_size):
  from jaxtrain.data import tokenizer as tokenizer_lib
  from jaxtrain.interop import decode, harness
  step_dir = runs.locate(w, None)
  cfg = runs.config_of(checkpoint.read_manifest(step_dir))
  setup, params = runs.restore_params(cfg, mesh_of(spec), step_dir)
  return harness.JaxtrainLM(setup.cfg, mesh_of(spec), setup.graphdef, params, tokenizer_lib.load(cfg.data.tokenizer),
                            decode.context_limit(cfg, w)[0], batch_size=batch_size)


def _hf_lm(hf_dir, max_length):
  from lm_eval.models.huggingface import HFLM
  from transformers import PreTrainedTokenizerFast
  tok = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
  return HFLM(pretrained=str(hf_dir), tokenizer=tok, dtype="float32", device="cpu", batch_size=4,
              max_length=max_length)


def test_same_accuracy_loglikelihoods_and_generations_as_lm_evals_hf_backend(exported, tmp_path, monkeypatch):
  import lm_eval
  from lm_eval.api.instance import Instance
  from lm_eval.tasks import TaskManager
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  ours = _jaxtrain_lm(exported / "w", "dp=2,tp=2", batch_size=3)  # a batch the mesh's 2 batch ways pad to 4
  ref = _hf_lm(exported / "hf", ours.max_length)
  manager = TaskManager(include_path=_tasks(tmp_path / "tasks"))
  got = {name: lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"], task_manager=manager,
                                       log_samples=True) for name, lm in (("ours", ours), ("ref", ref))}
  a, b = got["ours"], got["ref"]
  assert a["results"]["tiny_mc"]["acc,none"] == b["results"]["tiny_mc"]["acc,none"]
  assert a["results"]["tiny_gen"]["exact_match,none"] == b["results"]["tiny_gen"]["exact_match,none"]
  mc_a, mc_b = ([r[0] for s in x["samples"]["tiny_mc"] for r in s["resps"]] for x in (a, b))
  assert len(mc_a) == 12 and [g for _, g in mc_a] == [g for _, g in mc_b]
  np.testing.assert_allclose([l for l, _ in mc_a], [l for l, _ in mc_b], rtol=1e-4)
  gen_a, gen_b = ([s["resps"][0][0] for s in x["samples"]["tiny_gen"]] for x in (a, b))
  assert gen_a == gen_b and any(gen_a)
  # loglikelihood_rolling: one text in one window, one over several windows of max_length tokens
  texts = ["the quick brown fox", " ".join(["the lazy dog jumps over the quick brown fox"] * 12)]
  assert len(ours.tok_encode(texts[1])) > 2 * ours.max_length
  reqs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
  np.testing.assert_allclose(ours.loglikelihood_rolling(reqs), ref.loglikelihood_rolling(reqs), rtol=1e-4)


def test_eval_command_prints_the_table_and_writes_the_results(exported, tmp_path, run_cli):
  tasks = _tasks(tmp_path / "tasks")
  env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
  w = str(exported / "w")
  r = run_cli("jaxtrain.eval", "--workdir", w, "--tasks", "tiny_mc,tiny_gen", "--include-path", tasks, "--limit", "3",
              "--mesh", "dp=2", env=env)
  assert r.returncode == 0, r.stderr[-3000:]
  saved = json.loads((exported / "w" / "eval" / "step_3.json").read_text())
  assert saved["step"] == 3 and saved["n-samples"]["tiny_mc"]["effective"] == 3
  acc = saved["results"]["tiny_mc"]["acc,none"]
  row = next(line for line in r.stdout.splitlines() if line.startswith("|tiny_mc"))
  assert f"{acc:.4f}" in row and "acc" in row
  assert "exact_match" in next(line for line in r.stdout.splitlines() if line.startswith("|tiny_gen"))
  for argv, words in ((["--tasks", "tiny_nope", "--include-path", tasks], "--tasks: unknown task 'tiny_nope'"),
                      (["--tasks", "tiny_mc", "--include-path", str(tmp_path / "none")], "--include-path"),
                      (["--tasks", "tiny_mc,", "--include-path", tasks], "--tasks 'tiny_mc,': item 2 of 2 is empty")):
    bad = run_cli("jaxtrain.eval", "--workdir", w, *argv, env=env)
    assert bad.returncode == 2 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
