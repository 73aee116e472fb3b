"""`python -m jaxtrain.launch [--max-restarts K] [--restart-window-s S] [--backoff-s B] [--processes N] -- <train
arguments>`: runs `python -m jaxtrain.train <train arguments>` and restarts it when it fails (not after a user
error or a finished run). One per host under SLURM/Kubernetes; `--processes N` starts N local processes with a
local coordinator, to try a multi-process job on one machine."""

from __future__ import annotations

import sys

from jaxtrain import cli
from jaxtrain.core.errors import UserError, exit_with
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
  if args.max_restarts < 0 or args.restart_window_s <= 0 or args.backoff_s < 0 or args.processes < 1:
    bad = ("--max-restarts", args.max_restarts, ">= 0") if args.max_restarts < 0 else \
        ("--restart-window-s", args.restart_window_s, "> 0") if args.restart_window_s <= 0 else \
        ("--backoff-s", args.backoff_s, ">= 0") if args.backoff_s < 0 else ("--processes", args.processes, ">= 1")
    raise UserError(f"{bad[0]} {bad[1]:g}: must be {bad[2]}")
  if args.processes > 1 and (taken := [a for a in args.train_args if a.split("=", 1)[0] in CLUSTER_FLAGS]):
    raise UserError(f"--processes {args.processes} sets the cluster flags itself; drop {', '.join(taken)}")
  return args


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    args = parse_args(argv)
  except UserError as e:
    exit_with(e, "jaxtrain.launch")
  policy = supervisor.Policy(args.max_restarts, args.restart_window_s, args.backoff_s, args.processes)
  return supervisor.supervise(args.train_args, policy)


if __name__ == "__main__":
  sys.exit(main())
