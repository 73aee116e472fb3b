"""jaxtrain against one baseline at the GPU suite's shape (synthetic rows, remat none, rounds alternating):
    OUT=dir python tools/gpu_device/versus.py BASELINE NAME [SECTION.KEY=VALUE ...]   ->  dir/vs-NAME.json
tests/gpu/test_steps.py runs the same comparison on the config alone; this takes config overrides."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())


def main(base: str, name: str, extra: list[str]) -> None:
  import jax
  from jaxtrain.analysis import speed
  from tests.gpu import checks
  tiny = checks.tiny_requested()
  cfg = checks.load_config(tiny, ["model.remat=none", *extra])
  s = checks.shape(tiny)
  rep = speed.run(cfg, checks.one_device_mesh(jax.devices()[0]), name, steps=s["steps"], warmup=s["warmup"],
                  baselines=[base], rounds=s["rounds"], measure=False, batches=checks.synthetic_batches(cfg, 4))
  r, j, b = rep["ratios"][base], rep["jaxtrain"]["step_time_s"], rep["baseline_results"][base]["step_time_s"]
  print(f"{name} {' '.join(extra)}: jaxtrain {j['median'] * 1e3:.2f} ms, {base} {b['median'] * 1e3:.2f} ms, "
        f"jaxtrain/{base} tokens/s {r['median']:.3f} (rounds {[round(x, 3) for x in r['per_round']]})", flush=True)
  (Path(os.environ["OUT"]) / f"vs-{name}.json").write_text(json.dumps(rep, default=str, allow_nan=True))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3:])
