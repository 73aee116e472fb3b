"""`python -m jaxtrain.train`: train a transformer on a device mesh.

    python -m jaxtrain.train --mesh dp=8,tp=8 [--config tiny] [--set optim.lr=1e-3] [--steps N] [--workdir DIR]

Running the same command again resumes from the latest committed checkpoint.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from jaxtrain import cli
from jaxtrain.core import files, outputs
from jaxtrain.core.config import ALLOW_MISMATCH
from jaxtrain.core.errors import UserError


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.train", description="Train a decoder-only transformer on a device mesh.")
  cli.add_mesh_args(p, cluster=True)
  cli.add_config_args(p)
  p.add_argument("--steps", type=int,
                 help="stop once this many steps are done in total (default: train.steps); the LR schedule "
                      "still spans train.steps, so --steps 3 then --steps 6 equals one run of --steps 6")
  p.add_argument("--workdir", help="run directory: checkpoints/, metrics.jsonl, config.json (default: runs/<config>)")
  p.add_argument("--fresh", action="store_true",
                 help="start from step 0 even if the workdir has checkpoints (they are moved aside, not deleted)")
  p.add_argument("--resume-from", metavar="STEP|PATH",
                 help="resume from this committed step of the workdir, or from a checkpoint directory")
  p.add_argument("--allow-mismatch", default="", metavar="WHAT",
                 help="resume even though these differ from the checkpoint: comma list of "
                      f"{', '.join(ALLOW_MISMATCH)} (optim.name: the new optimizer's state starts fresh), or all")
  return p.parse_args(argv)


def preflight(args) -> tuple[Path, str | None]:
  """What train refuses before any device starts (launch asks too, once, before it starts trainers): the flags,
  the config and the workdir. The workdir and --resume-from as train uses them."""
  from jaxtrain.core import config
  if args.steps is not None and args.steps < 1:
    raise UserError(f"--steps {args.steps}: must be a positive integer")
  if args.fresh and args.resume_from:
    raise UserError("--fresh and --resume-from contradict each other; give one")
  resume_from = args.resume_from
  if resume_from and resume_from.isdigit() and not resume_from.isascii():
    raise UserError(f"--resume-from {resume_from!r}: a step is written in ASCII digits (0-9)")
  if resume_from is not None and not resume_from.isdigit():
    resume_from = str(files.user_path(resume_from, "--resume-from"))
    try:  # a path that cannot be one (too long, a file in it, a loop): one line now (cli.main), before any device
      os.stat(resume_from)
    except FileNotFoundError:
      pass  # said where the checkpoint is looked for, with the workdir's committed steps
  config.load(args.config, args.set)
  workdir = files.user_path(args.workdir if args.workdir is not None else f"runs/{config.run_name(args.config)}",
                            "--workdir")
  outputs.check(workdir, "--workdir", "workdir")  # never inside another run's files, a dataset or a model
  return workdir, resume_from


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    from jaxtrain.core import config
    from jaxtrain.run import loop
    if args.help_config:
      print(config.help_text())
      return 0
    workdir, resume_from = preflight(args)
    loop.allowed_mismatches(args.allow_mismatch)
    started = cli.start(args, "jaxtrain", runs_steps=True)
    set_prog(started.prog)
    t0 = time.perf_counter()
    summary = loop.run(started.cfg, started.mesh, workdir, config.run_name(args.config), stop_at=args.steps,
                       fresh=args.fresh, resume_from=resume_from, allow_mismatch=args.allow_mismatch)
    if summary.steps:
      print(f"done: {summary.steps} steps ({summary.skipped} skipped) in {time.perf_counter() - t0:.1f}s, "
            f"final loss {summary.final_loss:.4f}; metrics in {workdir / 'metrics.jsonl'}")
  return cli.main("jaxtrain", body)


if __name__ == "__main__":
  sys.exit(main())
