"""`python -m jaxtrain.goodput WORKDIR [--json]`: where the wall time of the workdir's last job went (the
goodput ledger, <workdir>/goodput.jsonl, written by train and launch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxtrain import cli
from jaxtrain.core.errors import UserError
from jaxtrain.run import goodput


def table(summary: dict) -> str:
  wall = summary["wall_s"] or 1.0
  rows = [f"{'category':<12}{'seconds':>10}{'share':>8}  what"]
  rows += [f"{k:<12}{v:>10.1f}{v / wall:>8.1%}  {goodput.CATEGORIES[k]}" for k, v in summary["seconds"].items()]
  rows.append(f"{'total':<12}{sum(summary['seconds'].values()):>10.1f}{'':>8}  the job's wall time, "
              f"{summary['wall_s']:.1f}s")
  return "\n".join(rows)


def main(argv=None) -> int:
  p = cli.Parser(prog="jaxtrain.goodput", description="The goodput ledger of a run's workdir.")
  p.add_argument("workdir")
  p.add_argument("--json", action="store_true", help="the summary as JSON")
  args = p.parse_args(argv)

  def body(set_prog):
    workdir = Path(args.workdir)
    if not (workdir / goodput.FILE).is_file():
      raise UserError(f"{args.workdir}: no {goodput.FILE} there; give the --workdir of a run (train or launch "
                      "write the ledger)")
    summary = goodput.summarize(goodput.read(workdir))
    if summary is None:
      raise UserError(f"{workdir / goodput.FILE}: no trainer started yet")
    print(json.dumps(summary, indent=1) if args.json else goodput.describe(summary) + "\n" + table(summary))
  return cli.main("jaxtrain.goodput", body)


if __name__ == "__main__":
  sys.exit(main())
