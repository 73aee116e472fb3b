"""lm-eval-harness tasks on jaxtrain's model (interop/harness.py), for `python -m jaxtrain.eval` and for training
(train.eval_tasks): the task names checked before a device starts, one evaluation, its record in
<workdir>/eval/step_<N>.json and its metrics as scalars."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import numbers
import random
from pathlib import Path

import numpy as np

from jaxtrain.core import files, parse
from jaxtrain.core.errors import UserError
from jaxtrain.run import metrics as metrics_lib


def resolve(text: str, include: str | None, what: str, include_what: str) -> tuple[list[str], object]:
  """(task names, lm-eval's TaskManager) of the comma list `text` (named `what` in errors); `include`: a folder of
  task YAMLs besides lm-eval's own (named `include_what`). An unknown name is one line."""
  try:
    from lm_eval.tasks import TaskManager
  except ImportError:
    raise UserError(f"{what} needs the lm-eval package: pip install 'jaxtrain[eval]'") from None
  names = parse.items(text, what)
  if not names:
    raise UserError(f"{what} '': name at least one lm-eval task")
  if include:
    include = str(files.user_path(include, include_what))
  manager = _manager(TaskManager, include or None)
  unknown = [n for n in names if n not in manager.all_tasks]
  if unknown:
    raise UserError(f"{what}: unknown task {unknown[0]!r} (not among lm-eval's tasks"
                    f"{f' nor those of {include_what}' if include else f'; local YAMLs: {include_what} DIR'})")
  return names, manager


@functools.lru_cache(maxsize=4)
def _manager(kind, include: str | None):
  """lm-eval's task index (seconds: it reads every task YAML it ships), once per folder in a process."""
  return kind(include_path=include)


def evaluate(lm, names: list[str], manager, limit: int | None) -> dict:
  """lm-eval's results dict of `names` on `lm` (at most `limit` documents per task)."""
  import lm_eval
  return lm_eval.simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=manager)


def write(workdir: Path, step: int, names: list[str], limit: int | None, results: dict) -> Path:
  """<workdir>/eval/step_<step>.json: the step, tasks, limit and lm-eval's results, written whole."""
  out = Path(workdir) / "eval" / f"step_{step}.json"
  out.parent.mkdir(exist_ok=True)
  record = {"step": step, "tasks": names, "limit": limit, "results": results["results"],
            "n-samples": results.get("n-samples"), "versions": results.get("versions")}
  files.write_atomic(out, json.dumps(record, indent=2, default=str) + "\n")  # lm-eval's numbers may be numpy's
  return out


def scalars(results: dict) -> dict[str, float]:
  """Each task's numeric metrics as lm_eval/<task>/<metric> (lm-eval's `metric,filter` key: the filter appended
  after a slash unless it is `none`)."""
  out = {}
  for task, metrics in results["results"].items():
    for key, value in metrics.items():
      metric, _, flt = key.partition(",")
      if not flt or isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        continue  # alias, sample counts, "N/A" stderrs
      out[f"{metrics_lib.TASK_PREFIX}{task}/{metric}" + ("" if flt == "none" else f"/{flt}")] = float(value)
  return out


class DuringTraining:
  """train.eval_tasks every train.eval_tasks_interval steps, with the run's live parameters on its mesh: the names
  checked at construction (before the run writes anything), the model wrapped at the first evaluation. Python's and
  NumPy's global random states, which lm-eval seeds, are restored after each evaluation."""

  def __init__(self, cfg, setup, workdir: Path, writer: bool):
    t = cfg.train
    self.interval = t.eval_tasks_interval
    if not self.interval:
      return
    self.names, self.manager = resolve(t.eval_tasks, t.eval_include_path, "train.eval_tasks",
                                       "train.eval_include_path")
    self.cfg, self.setup, self.workdir, self.writer = cfg, setup, workdir, writer
    self.limit = t.eval_tasks_limit or None
    self.lm = None

  def due(self, step: int) -> bool:
    return bool(self.interval) and step % self.interval == 0

  def __call__(self, step: int, params) -> dict[str, float]:
    """lm_eval/<task>/<metric> scalars of the tasks on `params` (the train state's own arrays, not copied)."""
    if self.lm is None:
      from jaxtrain.data import tokenizer as tokenizer_lib
      from jaxtrain.interop import decode, harness
      cfg, s = self.cfg, self.setup
      self.lm = harness.JaxtrainLM(cfg, s.mesh, s.graphdef, params, tokenizer_lib.load(cfg.data.tokenizer),
                                   decode.context_limit(cfg, self.workdir)[0],
                                   batch_size=cfg.train.batch_size // cfg.train.microbatches,
                                   compute=s.layout.compute)
    self.lm.params = params  # the step donates the state: each evaluation takes the current arrays
    if self.writer:
      print(f"step {step}: lm-eval tasks {','.join(self.names)}...", flush=True)
    states = random.getstate(), np.random.get_state()
    try:  # lm-eval's progress bars off the terminal (its log records go to the run's log)
      with contextlib.redirect_stderr(io.StringIO()):
        results = evaluate(self.lm, self.names, self.manager, self.limit)
    finally:
      random.setstate(states[0])
      np.random.set_state(states[1])
      self.lm.params = None  # no reference kept to donated arrays
    if self.writer:
      write(self.workdir, step, self.names, self.limit, results)
    return scalars(results)
