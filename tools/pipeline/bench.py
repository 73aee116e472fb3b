"""The pipeline schedules side by side on simulated CPU devices (docs/pipeline.md, "Measured on CPU"): each case
compiled once, then ROUNDS rounds that each time STEPS steps of every case in turn (the order reversed every other
round: the machine is shared and noisy); per case the median step, its ratio to the no-pipeline case, XLA's
compiled temporaries and the table's lock-step time with XLA's FLOPs per slot (inspect's costed bubble).

usage: XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
       python tools/pipeline/bench.py [--microbatches 8,16] [--rounds 3] [--steps 5] [--cases "pp=4 1f1b,pp=4 zb-h1"]
--stages P runs every case on P devices (pp=P, fsdp=P; the case names say P). With as many devices as cores and
--xla_cpu_multi_thread_eigen=false in XLA_FLAGS, each device computes on one core of its own: a bubble is an idle
core, as on accelerators (with 4 devices on 2 cores, a device that waits hands its core to another).
"""
import argparse
import statistics
import time

import jax

from jaxtrain import data
from jaxtrain.analysis import timeline
from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib, pipeline
from jaxtrain.run import step

BASE = ["model.n_layers=8", "model.scan_layers=true", "train.batch_size=64", "train.seq_len=64",
        "model.dtype=bfloat16"]
SCHEDULES = {"gpipe": ["pipeline.schedule=gpipe"], "1f1b": ["pipeline.schedule=1f1b"],
             "interleaved v=2": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
             "zb-h1": ["pipeline.schedule=zb-h1"],
             "zbv v=2": ["pipeline.schedule=zbv", "pipeline.virtual_stages=2"],
             "dualpipev v=2": ["pipeline.schedule=dualpipev", "pipeline.virtual_stages=2"]}


def cases(p: int) -> dict:
  """Case name -> (mesh, config overrides): fsdp over the P devices, then each schedule on P stages."""
  return {f"fsdp={p}": (f"fsdp={p}", []), **{f"pp={p} {k}": (f"pp={p}", v) for k, v in SCHEDULES.items()}}


def prepare(spec, sets, m, p):
  cfg = config.load("tiny", BASE + sets + [f"train.microbatches={m}"])
  setup = step.Setup(cfg, mesh_lib.build(mesh_lib.parse(spec), jax.devices()[:p]))
  it = data.batches(setup.cfg)
  batch = setup.device_batch(next(it))
  it.close()
  state = setup.init()
  compiled = setup.step.lower(state, batch).compile()
  state, _ = compiled(state, batch)  # warm-up
  jax.block_until_ready(state)
  costed = None
  if pipeline.active(setup.mesh):
    t = pipeline.table(setup.cfg, setup.mesh)
    costed = t.span(timeline.op_costs(t, timeline.slot_costs(setup)))
  return {"run": compiled, "state": state, "batch": batch, "times": [],
          "temp": compiled.memory_analysis().temp_size_in_bytes, "costed": costed}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--microbatches", default="8,16")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--steps", type=int, default=5)
  ap.add_argument("--stages", type=int, default=4, help="pipeline stages = devices of every case (default 4)")
  ap.add_argument("--cases", help="comma-separated case names, e.g. 'pp=4 1f1b,pp=4 zb-h1' (fsdp=P always runs)")
  args = ap.parse_args()
  p, known = args.stages, cases(args.stages)
  ref_name, base_name = f"fsdp={p}", f"pp={p} 1f1b"
  names = [ref_name, *(n for n in (args.cases.split(",") if args.cases else known) if n != ref_name)]
  for m in map(int, args.microbatches.split(",")):
    cases_m = {name: prepare(*known[name], m, p) for name in names}
    order = list(cases_m)
    for r in range(args.rounds):
      for name in (order if r % 2 == 0 else order[::-1]):
        c = cases_m[name]
        for _ in range(args.steps):
          t0 = time.perf_counter()
          c["state"], _ = c["run"](c["state"], c["batch"])
          jax.block_until_ready(c["state"])
          c["times"].append(time.perf_counter() - t0)
    ref = statistics.median(cases_m[ref_name]["times"])
    print(f"\nm={m}: {args.rounds} alternating rounds x {args.steps} steps per case")
    print(f"| m | mesh, schedule | step ms median [min..max] | vs {ref_name} | compiled temporaries per device (B) "
          "| lock-step time, XLA FLOPs per slot (vs 1f1b) |")
    print("|---|---|---|---|---|---|")
    base = cases_m[base_name]["costed"] if base_name in cases_m else None
    for name, c in cases_m.items():
      med = statistics.median(c["times"])
      lock = "-" if c["costed"] is None else f"{c['costed']:.3g}" + (f" ({c['costed'] / base:.2f})" if base else "")
      print(f"| {m} | {name} | {med * 1e3:.0f} [{min(c['times']) * 1e3:.0f}..{max(c['times']) * 1e3:.0f}] | "
            f"{med / ref:.2f} | {c['temp']:,} | {lock} |", flush=True)


if __name__ == "__main__":
  main()
