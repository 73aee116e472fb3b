"""`python -m jaxtrain.hf import|export`: Hugging Face checkpoints in and out (docs/huggingface.md).

    python -m jaxtrain.hf import HF_DIR --workdir W [--mesh M] [--set section.key=value ...]
    python -m jaxtrain.hf export --workdir W [--step N] --out HF_DIR [--dtype bfloat16] [--adapter] [--mesh M]
"""

from __future__ import annotations

import argparse
import sys

from jaxtrain import cli
from jaxtrain.core import files, outputs
from jaxtrain.core.errors import UserError
from jaxtrain.interop import hf, hf_export


def parse_args(argv=None) -> argparse.Namespace:
  p = cli.Parser(prog="jaxtrain.hf", description="Hugging Face checkpoints in and out.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=cli.Parser)
  s = sub.add_parser("import", help="HF checkpoint dir -> jaxtrain config + step-0 checkpoint")
  s.add_argument("hf_dir", help="local directory with config.json and *.safetensors (and tokenizer.json)")
  s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                 help="override a config key of the written config (repeatable)")
  s.add_argument("--name", help="config name: writes WORKDIR/NAME.toml (default: the HF directory's name)")
  e = sub.add_parser("export", help="jaxtrain checkpoint -> HF checkpoint dir")
  e.add_argument("--step", type=int, help="committed step to export (default: the latest)")
  e.add_argument("--out", required=True, help="output directory for the HF checkpoint")
  e.add_argument("--dtype", default="bfloat16", choices=sorted(hf.DTYPES), help="tensor dtype (default: bfloat16)")
  e.add_argument("--adapter", action="store_true",
                 help="LoRA runs: write the adapters alone as a PEFT adapter (adapter_config.json, "
                 "adapter_model.safetensors); without it the model is written with them merged")
  e.add_argument("--allow-base-change", action="store_true",
                 help="--adapter: write the adapter although the base model it names (the import's source) no "
                 "longer holds the weights the run was imported from (default: refused)")
  e.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, GB (default: 5)")
  for q in (s, e):
    q.add_argument("--workdir", required=True, help="jaxtrain run directory")
    cli.add_mesh_args(q, cluster=True)
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  prog = f"jaxtrain.hf {args.command}"

  def body(set_prog):
    workdir = files.user_path(args.workdir, "--workdir")
    if args.command == "import":
      outputs.check(workdir, "--workdir", "workdir", sources=[args.hf_dir])  # before anything is read or written
      plan = hf.plan_import(args.hf_dir, str(workdir), args.set, args.name)
      started = cli.start(args, prog, cfg=plan.cfg)
      set_prog(started.prog)
      path = hf.run_import(plan, started.mesh)
      print(f"config: {path}\nnext: python -m jaxtrain.train --workdir {plan.workdir} --config {path} --mesh ...")
    else:
      from jaxtrain.run import checkpoint, runs
      if not 0 < args.max_shard_gb < float("inf"):  # also refuses nan
        raise UserError(f"--max-shard-gb {args.max_shard_gb}: must be a finite number > 0")
      if args.step is not None and args.step < 0:
        raise UserError(f"--step {args.step}: a step is an integer >= 0")
      out = files.user_path(args.out, "--out")
      # before anything is read or written: never the run, its checkpoints, a dataset or a model not exported here
      outputs.check(out, "--out", "export", sources=[workdir / "checkpoints"])
      files.check_output_dir(out, "--out")
      step_dir = runs.locate(workdir, args.step)
      started = cli.start(args, prog, cfg=runs.config_of(checkpoint.read_manifest(step_dir)))
      set_prog(started.prog)
      hf_export.run_export(started.cfg, started.mesh, step_dir, out, args.dtype, int(args.max_shard_gb * 1e9), workdir,
                            args.adapter, args.allow_base_change)
  return cli.main(prog, body)


if __name__ == "__main__":
  sys.exit(main())
