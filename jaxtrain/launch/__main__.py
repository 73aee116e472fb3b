"""`python -m jaxtrain.launch [--max-restarts K] [--restart-window-s S] [--backoff-s B] [--processes N] -- <train
arguments>`: runs `python -m jaxtrain.train <train arguments>` and restarts it when it fails (not after a user
error or a finished run). One per host under SLURM/Kubernetes; `--processes N` starts N local processes with a
local coordinator, to try a multi-process job on one machine."""

from __future__ import annotations

import math
import sys

from jaxtrain import cli
from jaxtrain.core import files
from jaxtrain.core.errors import UserError
from jaxtrain.launch import supervisor

CLUSTER_FLAGS = ("--coordinator", "--num-processes", "--process-id")


def parse_args(argv):
  p = cli.Parser(prog="jaxtrain.launch", description="Run the trainer and restart it when it fails.")
  d = supervisor.Policy()
  p.add_argument("--max-restarts", type=int, default=d.max_restarts, metavar="K",
                 help=f"restarts allowed within the window; one more failure stops the job (default {d.max_restarts})")
  p.add_argument("--restart-window-s", type=float, default=d.window_s, metavar="S",
                 help=f"the window over which failures count (default {d.window_s:g})")
  p.add_argument("--backoff-s", type=float, default=d.backoff_s, metavar="B",
                 help=f"wait before a restart; across hosts keep it above distributed.heartbeat_timeout_s's detection "
                      f"time so the survivors have exited (default {d.backoff_s:g})")
  p.add_argument("--processes", type=int, default=1, metavar="N",
                 help="start N local trainer processes with a local coordinator (one machine; default 1)")
  p.add_argument("train_args", nargs="*", metavar="-- TRAIN_ARGS", help="arguments of python -m jaxtrain.train")
  args = p.parse_args(argv)
  for flag, value, ok, rule in (("--max-restarts", args.max_restarts, args.max_restarts >= 0, ">= 0"),
                                ("--restart-window-s", args.restart_window_s, 0 < args.restart_window_s < math.inf,
                                 "a finite number of seconds > 0"),
                                ("--backoff-s", args.backoff_s, 0 <= args.backoff_s < math.inf,
                                 "a finite number of seconds >= 0"),
                                ("--processes", args.processes, args.processes >= 1, ">= 1")):
    if not ok:
      raise UserError(f"{flag} {value:g}: must be {rule}")
  if args.processes > 1 and (taken := [a for a in args.train_args if a.split("=", 1)[0] in CLUSTER_FLAGS]):
    raise UserError(f"--processes {args.processes} sets the cluster flags itself; drop {', '.join(taken)}")
  return args


def check_train_args(train_args: list[str]) -> None:
  """What the trainer would refuse before it starts, refused here once (not once per trainer, nor after a
  trainer has set up JAX's compilation cache in a workdir that cannot be one)."""
  from jaxtrain import train
  args = train.parse_args(train_args)
  if not args.help_config:
    workdir, _ = train.preflight(args)
    files.check_output_dir(workdir, "--workdir")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv

  def body(set_prog):
    args = parse_args(argv)
    set_prog("jaxtrain")  # the trainer's arguments: refused in the trainer's words
    check_train_args(args.train_args)
    set_prog("jaxtrain.launch")
    policy = supervisor.Policy(args.max_restarts, args.restart_window_s, args.backoff_s, args.processes)
    return supervisor.supervise(args.train_args, policy)
  return cli.main("jaxtrain.launch", body)


if __name__ == "__main__":
  sys.exit(main())
