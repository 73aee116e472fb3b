"""The GPU suite's step (tests/gpu shapes, synthetic rows) timed alone, with a profile of its top ops:
    OUT=dir BD=30 python tools/gpu_device/breakdown.py NAME [SECTION.KEY=VALUE ...]   ->  dir/bd-NAME.json
The same as `python -m jaxtrain.bench --breakdown N` without a data pipeline (no grain on the host)."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())


def main(name: str, extra: list[str]) -> None:
  import jax
  from jaxtrain.analysis import speed
  from tests.gpu import checks
  tiny = checks.tiny_requested()
  cfg = checks.load_config(tiny, extra)
  rep = speed.run(cfg, checks.one_device_mesh(jax.devices()[0]), name, steps=10, warmup=3, baselines=[], rounds=1,
                  measure=False, batches=checks.synthetic_batches(cfg, 4), breakdown=int(os.environ.get("BD", "30")),
                  trace_dir=Path("/tmp") / f"trace-{name}")
  (Path(os.environ["OUT"]) / f"bd-{name}.json").write_text(json.dumps(rep, default=str, allow_nan=True))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
