"""`python -m jaxtrain.bench`: the real train step's speed, with baselines side by side
(docs/performance.md); the work is in analysis/speed.py and analysis/compare.py."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from jaxtrain import cli
from jaxtrain.analysis import speed
from jaxtrain.core import files, outputs, parse
from jaxtrain.core.errors import UserError


def parse_args(argv=None):
  p = cli.Parser(prog="jaxtrain.bench", description="Time the real train step; compare with baselines.")
  cli.add_config_args(p, help_config=False)
  cli.add_mesh_args(p)
  p.add_argument("--steps", type=int, default=10, help="timed steps per round and side (default 10)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps per side before the first round (default 2)")
  p.add_argument("--baseline", default="none", metavar="none|minimal|torch|minimal,torch",
                 help="minimal: a plain jax.jit step; torch: PyTorch, torch.compile + SDPA; both: minimal,torch "
                      "(default none)")
  p.add_argument("--rounds", type=int, default=3, help="alternating rounds with a baseline (default 3)")
  p.add_argument("--measure-peak", action="store_true", help="time a large bf16 matmul; MFU also against it")
  p.add_argument("--out", help="JSON result file (default <workdir>/bench.json)")
  p.add_argument("--workdir", help="where the default --out goes (default runs/<config>)")
  p.add_argument("--compare", action="append", default=[], metavar="NAME[@MESH]:SECTION.KEY=VALUE[,...]",
                 help="time variants of the config in one run, alternating rounds, with compiled memory per "
                      "device (repeatable; NAME@MESH: that variant on its own mesh of the same devices, e.g. "
                      "tp@data=2,tensor=4:; see jaxtrain/analysis/compare.py); no baselines")
  p.add_argument("--breakdown", type=int, default=0, metavar="N",
                 help="after timing, trace a few steps with jax.profiler and print the N ops that take the most time")
  return p.parse_args(argv)


def parse_baselines(text: str) -> list[str]:
  names = parse.items(text, "--baseline")
  if names == ["none"]:
    return []
  if not names or len(set(names)) != len(names) or not set(names) <= set(speed.BASELINES):
    raise UserError(f"--baseline {text!r}: use none, or one or more of {', '.join(speed.BASELINES)} "
                    "separated by commas")
  return names


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if any(a == "--suite" or a.startswith("--suite=") for a in argv):  # the GPU checks became a pytest suite
    def moved(_):
      raise UserError("--suite gpu is now a pytest suite: run `python -m pytest -m gpu tests/gpu` in a source checkout")
    return cli.main("jaxtrain.bench", moved)
  args = parse_args(argv)

  def body(set_prog):
    from jaxtrain.core import config
    from jaxtrain.parallel import mesh as mesh_lib
    for flag, value, lo in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--rounds", args.rounds, 1),
                            ("--breakdown", args.breakdown, 0)):
      if value < lo:
        raise UserError(f"{flag} {value}: must be an integer >= {lo}")
    baselines = parse_baselines(args.baseline)
    cfg = config.load(args.config, args.set)
    name = config.run_name(args.config)
    out = files.user_path(args.out, "--out") if args.out is not None else files.user_path(
        args.workdir if args.workdir is not None else f"runs/{name}", "--workdir") / "bench.json"
    outputs.check(out, "--out", "file", sources=[args.config] if Path(args.config).is_file() else [])
    if not args.out:
      from jaxtrain.run import runfiles
      runfiles.prepare_workdir(out.parent)
    if not out.parent.is_dir():  # checked before a long run, not after
      raise UserError(f"--out {args.out}: directory {str(out.parent)!r} does not exist")
    for baseline in baselines:  # not `name`: that is the config's, which the report names
      speed.check_baseline(cfg, baseline)
    if "torch" in baselines:
      # JAX would otherwise reserve 75% of GPU memory up front, leaving torch the rest.
      os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sizes = mesh_lib.parse(args.mesh)
    if -1 not in sizes.values():  # before the mesh is built: it may need simulated devices
      _check_one_device(baselines, args.mesh, math.prod(sizes.values()))
    started = cli.start(args, "jaxtrain.bench", runs_steps=True)  # the trainer's start-up: its XLA flags, its mesh
    if args.compare:
      return _compare(args, started.mesh, out, baselines)
    _check_one_device(baselines, args.mesh, started.mesh.size)
    rep = speed.run(started.cfg, started.mesh, name, steps=args.steps, warmup=args.warmup,
                    baselines=baselines, rounds=args.rounds, measure=args.measure_peak,
                    breakdown=args.breakdown, trace_dir=out.parent / (out.stem + "-trace"))
    _write(args, out, rep, speed.table)
  return cli.main("jaxtrain.bench", body)


def _compare(args, mesh, out: Path, baselines) -> int:
  from jaxtrain.analysis import compare as bench_compare
  if baselines:
    raise UserError("--compare and --baseline do not mix; give one")
  variants = bench_compare.parse(args.compare)
  _check_same_shape(args, variants)
  rep = bench_compare.run(args.config, args.set, variants, mesh, steps=args.steps,
                          warmup=args.warmup, rounds=args.rounds)
  _write(args, out, rep, bench_compare.table)
  return 0


def _check_same_shape(args, variants) -> None:
  """The variants are timed on the same batches, so their step times compare as they are: a variant with another
  batch shape could not share them (and its step time would not compare), so it is refused, naming both shapes."""
  from jaxtrain.core import config
  shapes = {}
  for name, sets in variants:
    t = config.load(args.config, list(args.set) + sets).train
    shapes[name] = (t.batch_size, t.seq_len)
  (first, shape), *rest = shapes.items()
  for name, other in rest:
    if other != shape:
      raise UserError(f"--compare {first} runs batch {shape[0]} x {shape[1]} tokens but {name} runs "
                      f"{other[0]} x {other[1]} (train.batch_size x train.seq_len): variants are timed on the same "
                      "batches, so they must share that shape; compare other shapes in separate bench runs")


def _write(args, out: Path, rep: dict, table) -> None:
  try:
    files.write_json_atomic(out, rep)
  except OSError as e:
    raise UserError(f"--out {args.out}: cannot write ({e.strerror})") from None
  print(f"wrote {out}")
  print(table(rep))


def _check_one_device(baselines: list[str], spec: str, devices: int) -> None:
  if baselines and devices != 1:
    raise UserError(f"--baseline {','.join(baselines)} runs on one device; the mesh {spec!r} has {devices} "
                    f"(use --mesh fsdp=1)")


if __name__ == "__main__":
  sys.exit(main())
