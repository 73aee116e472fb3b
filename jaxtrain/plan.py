"""`python -m jaxtrain.plan`: the best layout of a model on N GPUs, found before a GPU is rented.

    python -m jaxtrain.plan --config llama3.1-8b --gpus 8 --device H100 [--gpus-per-host 8] [--seq-len L]
        [--global-batch B] [--budget-min M] [--compile-top K] [--top N] [--output PATH] [--set ...]

Enumerates meshes and options, prunes them with the config's own refusals and the memory bill, ranks them,
compiles the best for the target with XLA's GPU compiler (the gpu-aot extra; no GPU needed), prints the table and
writes the winner's mesh preset with the --set overrides to paste (jaxtrain.analysis.planner; docs/planner.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxtrain import cli
from jaxtrain.core.errors import UserError


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.plan", description="Find the fastest layout of a model on N GPUs that fits, "
                                                   "before any GPU is touched.")
  cli.add_config_args(p, help_config=False)
  p.add_argument("--gpus", type=int, required=True, help="number of GPUs to plan for")
  p.add_argument("--device", default="H100", metavar="KIND",
                 help="GPU kind, a row of the device table with peak FLOPs and link bandwidth: H100, H200, B200, A100 "
                      "(compiles for H100, H200, A100-80GB; default H100); or cpu: --gpus simulated CPU devices of "
                      "this host, measured here, compiled with XLA:CPU")
  p.add_argument("--gpus-per-host", type=int, help="GPUs per host: tensor stays inside one, expert fills one before "
                                                    "crossing hosts (default 8; "
                                                    "not with --device cpu: this one host)")
  p.add_argument("--seq-len", type=int, help="tokens per sequence (train.seq_len; default: the config's)")
  p.add_argument("--global-batch", type=int, help="sequences per step (train.batch_size; default: the config's)")
  p.add_argument("--budget-min", type=float, default=15.0, help="time budget in minutes: no compile starts that "
                                                                "would end after it (default 15)")
  p.add_argument("--compile-top", type=int, default=8, help="compile this many of the best layouts (default 8; "
                                                            "0: the analytic ranking only)")
  p.add_argument("--top", type=int, default=15, help="rows of the table (default 15)")
  p.add_argument("--output", metavar="PATH", help="where the winner's mesh preset goes (default: "
                                                  "plan-<config>-<N>x<device>.toml here)")
  return p.parse_args(argv)


def check(args) -> None:
  """Each flag's bad value in one line."""
  from jaxtrain.parallel import devices
  if args.gpus < 1:
    raise UserError(f"--gpus {args.gpus}: must be a positive number of GPUs")
  if args.device.lower() == "cpu":
    if args.gpus_per_host is not None:
      raise UserError(f"--gpus-per-host {args.gpus_per_host}: --device cpu plans the devices of this one host; "
                      "drop it")
    return _check_numbers(args)
  args.gpus_per_host = 8 if args.gpus_per_host is None else args.gpus_per_host
  if args.gpus_per_host < 1 or (args.gpus > args.gpus_per_host and args.gpus % args.gpus_per_host):
    raise UserError(f"--gpus-per-host {args.gpus_per_host}: must be >= 1 and divide --gpus {args.gpus}")
  row = devices.TABLE.get(devices.of(args.device).key or "")
  if row is None or not (row.peak_bf16_flops and row.link_bandwidth and row.memory_bytes):
    known = [k for k, r in devices.TABLE.items() if r.peak_bf16_flops and r.link_bandwidth and r.memory_bytes]
    raise UserError(f"--device {args.device!r}: the planner needs a GPU with peak FLOPs, memory and link bandwidth "
                    f"in the device table: {', '.join(known)}; or cpu")
  _check_numbers(args)


def _check_numbers(args) -> None:
  for flag, v in (("--seq-len", args.seq_len), ("--global-batch", args.global_batch)):
    if v is not None and v < 1:
      raise UserError(f"{flag} {v}: must be a positive integer")
  if not args.budget_min > 0:
    raise UserError(f"--budget-min {args.budget_min}: must be a positive number of minutes")
  if args.compile_top < 0 or args.top < 1:
    raise UserError(f"--compile-top {args.compile_top} / --top {args.top}: must be >= 0 / >= 1")


def main(argv=None) -> int:
  args = parse_args(argv)

  def body(set_prog):
    from jaxtrain.analysis import planner
    from jaxtrain.core import config, files, native
    native.capture()  # before any backend starts: XLA's C++ warnings (one per compile) off the terminal
    check(args)
    sets = [*args.set, *([f"train.seq_len={args.seq_len}"] if args.seq_len else []),
            *([f"train.batch_size={args.global_batch}"] if args.global_batch else [])]
    name = config.run_name(args.config)
    output = Path(args.output or f"plan-{name}-{args.gpus}x{args.device.lower()}.toml")
    if output.is_dir() or not output.parent.is_dir():
      raise UserError(f"--output {str(output)!r}: must be a file path in an existing directory")
    if args.device.lower() == "cpu":  # the CPU backend only (no GPU plugin's start-up), all devices on this host
      import jax
      jax.config.update("jax_platforms", "cpu")
    target = planner.Target(args.device, args.gpus, args.gpus if args.device.lower() == "cpu" else args.gpus_per_host)
    out = planner.plan(args.config, sets, target, compile_top=args.compile_top, budget_s=args.budget_min * 60,
                       progress=sys.stderr.isatty())
    print(planner.render(out, args.top))
    if not out.results:
      raise UserError(f"no layout of {name} runs and fits on {args.gpus} x {args.device} (see the counts above)")
    best = out.results[0].layout
    files.write_atomic(output, best.preset(f"jaxtrain.plan: {name} on {args.gpus} x {args.device}: {best.label()}"))
    overrides = " ".join(f"--set {s}" for s in [*sets, *best.overrides()])
    print(f"\nwinner: {best.label()}\n  mesh preset written to {output}\n  "
          f"python -m jaxtrain.train --config {args.config} --mesh {output} {overrides}")
  return cli.main("jaxtrain.plan", body)


if __name__ == "__main__":
  sys.exit(main())
