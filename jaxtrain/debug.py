"""`python -m jaxtrain.debug`: the minimal debug protocol as one command (docs/training.md#the-debug-protocol).

    python -m jaxtrain.debug --config tiny --mesh data=2,fsdp=2 [--set ...] [--overfit-steps 150] ...

One verdict line per check, PASS or FAIL with its figure; exit 0 when all pass, 1 when one fails, 2 on bad input.
The work is in jaxtrain/run/protocol.py.
"""

from __future__ import annotations

import sys

from jaxtrain import cli


def parse_args(argv=None):
  from jaxtrain.run.protocol import Options
  d = Options()
  p = cli.Parser(prog="jaxtrain.debug", description="Run the minimal debug protocol: overfit one batch, the labels' "
                 "shift and mask, the logged grad norm and LR, resume equal to uninterrupted, mesh equal to one "
                 "device.")
  cli.add_config_args(p, help_config=False)
  cli.add_mesh_args(p)
  p.add_argument("--overfit-steps", type=int, default=d.overfit_steps,
                 help=f"steps on one fixed batch (default {d.overfit_steps})")
  p.add_argument("--overfit-loss", type=float, default=d.overfit_loss,
                 help=f"the loss the overfit run must reach within those steps (default {d.overfit_loss:g})")
  p.add_argument("--resume-steps", type=int, default=d.resume_steps,
                 help=f"R: R steps + checkpoint + resume R against 2R uninterrupted (default {d.resume_steps})")
  p.add_argument("--resume-rtol", type=float, default=d.resume_rtol,
                 help=f"relative tolerance of the resume's losses and grad norms (default {d.resume_rtol:g}: equal)")
  p.add_argument("--mesh-steps", type=int, default=d.mesh_steps,
                 help=f"float32 steps compared between the mesh and one device (default {d.mesh_steps})")
  p.add_argument("--mesh-rtol", type=float, default=d.mesh_rtol,
                 help=f"relative tolerance of the mesh's losses and grad norms (default {d.mesh_rtol:g})")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    from jaxtrain.run import protocol
    opts = protocol.Options(args.overfit_steps, args.overfit_loss, args.resume_steps, args.resume_rtol,
                            args.mesh_steps, args.mesh_rtol)
    protocol.check_options(opts)
    started = cli.start(args, "jaxtrain.debug", runs_steps=True)
    set_prog(started.prog)
    verdicts = protocol.run(started.cfg, started.mesh, opts, emit=lambda line: print(line, flush=True))
    failed = [v.name for v in verdicts if not v.ok]
    print(f"debug: {len(verdicts) - len(failed)} of {len(verdicts)} passed" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
  return cli.main("jaxtrain.debug", body)


if __name__ == "__main__":
  sys.exit(main())
