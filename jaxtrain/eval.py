"""`python -m jaxtrain.eval`: lm-eval-harness tasks on a checkpoint, on the mesh (docs/huggingface.md#evaluation).

    python -m jaxtrain.eval --workdir W --tasks T1,T2 [--limit N] [--step S] [--include-path DIR]
        [--batch-size B] [--mesh M]

Results are printed as lm-eval prints them and written to <workdir>/eval/step_<S>.json.
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain import cli
from jaxtrain.core import files
from jaxtrain.core.errors import UserError


def parse_args(argv=None) -> argparse.Namespace:
  p = cli.Parser(prog="jaxtrain.eval", description="Evaluate a jaxtrain checkpoint on lm-eval-harness tasks.")
  p.add_argument("--workdir", required=True, help="run directory (trained or imported)")
  p.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
  p.add_argument("--step", type=int, help="committed step to evaluate (default: the latest)")
  p.add_argument("--limit", type=int, help="at most this many documents per task")
  p.add_argument("--include-path", help="a folder of task YAMLs besides lm-eval's own (as lm-eval's --include_path)")
  p.add_argument("--batch-size", type=int, default=16, help="sequences scored per batch (default: 16)")
  cli.add_mesh_args(p)
  return p.parse_args(argv)


def _tasks(args) -> tuple[list[str], object]:
  """(task names, lm-eval's TaskManager), every name checked before a device starts."""
  from jaxtrain.interop import tasks
  return tasks.resolve(args.tasks, args.include_path, "--tasks", "--include-path")


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    if args.limit is not None and args.limit < 1:
      raise UserError(f"--limit {args.limit}: must be at least 1")
    if args.batch_size < 1:
      raise UserError(f"--batch-size {args.batch_size}: must be at least 1")
    from jaxtrain.data import tokenizer as tokenizer_lib
    from jaxtrain.run import checkpoint, runs
    workdir = files.user_path(args.workdir, "--workdir")
    step_dir = runs.locate(workdir, args.step)
    cfg = runs.config_of(checkpoint.read_manifest(step_dir))
    names, manager = _tasks(args)
    started = cli.start(args, "jaxtrain.eval", cfg=cfg, runs_steps=True)
    set_prog(started.prog)
    from lm_eval.utils import make_table
    from jaxtrain.interop import decode, harness, tasks
    setup, params = runs.restore_params(cfg, started.mesh, step_dir)
    lm = harness.JaxtrainLM(setup.cfg, started.mesh, setup.graphdef, params, tokenizer_lib.load(cfg.data.tokenizer),
                            decode.context_limit(cfg, workdir)[0], batch_size=args.batch_size)
    results = tasks.evaluate(lm, names, manager, args.limit)
    print(make_table(results))
    if "groups" in results:
      print(make_table(results, "groups"))
    out = tasks.write(workdir, int(step_dir.name), names, args.limit, results)
    print(f"results in {out}", file=sys.stderr)
  return cli.main("jaxtrain.eval", body)


if __name__ == "__main__":
  sys.exit(main())
