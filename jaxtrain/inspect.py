"""`python -m jaxtrain.inspect`: how a run lays out and whether it fits, before launch.

    python -m jaxtrain.inspect --mesh fsdp=8,tp=8 --config llama3-8b [--set ...] [--compile]
        [--device-memory 80GiB|H100] [--margin 0.1] [--warn-replicated 16MiB] [--json]

Prints every parameter's sharding, the memory bill per device, model FLOPs and the bytes each
mesh axis moves per step, allocating nothing; `--compile` also compiles the real train step from
abstract inputs and prints XLA's memory analysis beside the bill. Simulated CPU devices stand in.
"""

from __future__ import annotations

import json
import sys

from jaxtrain import cli
from jaxtrain.core.errors import UserError


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.inspect", description="Show parameter shardings, the memory bill, FLOPs and "
                                                      "communication of a run before launching it.")
  cli.add_mesh_args(p)
  cli.add_config_args(p, help_config=False)
  p.add_argument("--compile", action="store_true", help="also compile the train step and print XLA's memory analysis")
  p.add_argument("--device", metavar="KIND",
                 help="target device kind, a name of the device table (H100, H200, A100-80GB, B200, ...): the bill, "
                      "its attention kernel and the verdict are for that device, whatever runs inspect; with "
                      "--compile (H100, H200, A100-80GB) XLA's GPU compiler compiles the step for a mesh of them "
                      "without any GPU here (needs the gpu-aot extra)")
  p.add_argument("--device-memory", metavar="SIZE|KIND",
                 help="memory per device for the verdict: a size (80GiB, 80GB, bytes) or a device kind (H100, ...); "
                      "default: the local device's kind, if known")
  p.add_argument("--margin", type=float, default=0.10,
                 help="temporaries and communication buffers, as a fraction of the rest of the bill (default 0.10)")
  p.add_argument("--warn-replicated", default="16MiB", metavar="SIZE",
                 help="warn about a fully replicated parameter of at least this size per device (default 16MiB)")
  p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    from jaxtrain.analysis import memory, report
    from jaxtrain.core import config
    if not 0 <= args.margin < 10:
      raise UserError(f"--margin {args.margin}: must be a fraction >= 0 (e.g. 0.1)")
    threshold = memory.parse_size(args.warn_replicated, "--warn-replicated")
    if args.device_memory and args.device_memory.strip()[:1].isdigit() and memory.parse_size(args.device_memory) < 1:
      raise UserError(f"--device-memory {args.device_memory!r}: must be a positive size (e.g. 80GiB) or a device kind")
    # Without --device, a multi-host mesh is looked at from one machine: its hosts are simulated.
    started = cli.start(args, "jaxtrain.inspect", mesh=args.device is None, simulate_hosts=True)
    mesh, device_memory = (started.mesh, args.device_memory) if args.device is None else report.target_mesh(
        args.device, args.mesh, args.compile, args.device_memory)
    rep = report.report(started.cfg, mesh, config.run_name(args.config), compile=args.compile,
                        device_memory=device_memory, margin=args.margin, warn_replicated=threshold, device=args.device)
    print(json.dumps(rep, indent=1) if args.json else report.render(rep))
  return cli.main("jaxtrain.inspect", body)


if __name__ == "__main__":
  sys.exit(main())
