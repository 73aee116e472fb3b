"""`python -m jaxtrain.bench --compare NAME:k=v,k=v ...`: variants of one config timed in
one process, alternating round by round (so a machine's drift hits every variant alike),
each with XLA's compiled memory per device.

Every variant is the base config (--config, --set) plus its own overrides, on the same
mesh and the same batches (jaxtrain's data path, staged on the device before timing).
Per round, each variant runs --steps timed steps (pipelined, as the trainer measures);
reported per variant: step time statistics over all rounds, the median of each round,
compile time, and `compiled.memory_analysis()` (per device: temporaries, arguments,
outputs, aliased, generated code).
"""

from __future__ import annotations

import time

from jaxtrain.core.errors import UserError


def parse(items: list[str]) -> list[tuple[str, list[str]]]:
  """['name:k=v,k=v', ...] -> [(name, ['k=v', ...])]."""
  out = []
  for item in items:
    name, colon, sets = item.partition(":")
    if not colon or not name.strip():
      raise UserError(f"--compare {item!r} must look like NAME:section.key=value[,section.key=value...]")
    out.append((name.strip(), [s.strip() for s in sets.split(",") if s.strip()]))
  names = [n for n, _ in out]
  if len(set(names)) != len(names):
    raise UserError(f"--compare names must differ: {', '.join(names)}")
  return out


def _same_shapes(a, b) -> bool:
  import jax
  sa, sb = jax.tree.structure(a), jax.tree.structure(b)
  return sa == sb and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a),
                                                                                    jax.tree.leaves(b)))


def _variant(cfg, mesh, batches, first: dict):
  """`first` holds the first variant's initial state on the host: a variant whose state has
  the same shapes starts from it (same weights, and one initializer compile fewer)."""
  import jax
  from jaxtrain.run import step as step_lib
  setup = step_lib.Setup(cfg, mesh)
  if "state" in first and _same_shapes(first["state"], jax.eval_shape(setup.init)):
    state = jax.device_put(first["state"], setup.state_shardings)
  else:
    state = setup.init()
    first.setdefault("state", jax.device_get(state))
  dev = [setup.device_batch(b) for b in batches]
  t = time.perf_counter()
  compiled = setup.step.lower(state, dev[0]).compile()
  compile_s = time.perf_counter() - t
  from jaxtrain.analysis import gpu_compile
  m = gpu_compile.CompiledMemory.of(compiled)
  memory = None if m is None else {"temp_bytes": m.temporaries, "argument_bytes": m.arguments,
                                   "output_bytes": m.outputs, "alias_bytes": m.aliased, "code_bytes": m.generated_code}
  box = {"state": state, "i": 0}

  def run():
    box["state"], metrics = compiled(box["state"], dev[box["i"] % len(dev)])
    box["i"] += 1
    return metrics["loss"]
  return run, jax.block_until_ready, compile_s, memory


def run(base_name: str, base_sets: list[str], variants: list[tuple[str, list[str]]], mesh, *, steps: int,
        warmup: int, rounds: int) -> dict:
  import numpy as np
  from jaxtrain.analysis import timing
  from jaxtrain.core import config
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import step as step_lib
  cfgs = {name: config.load(base_name, base_sets + sets) for name, sets in variants}
  first = next(iter(cfgs.values()))
  batches = timing.first_batches(first, step_lib.Setup(first, mesh), min(steps, 4), unpacked=False)
  first: dict = {}
  sides = {name: _variant(cfg, mesh, batches, first) for name, cfg in cfgs.items()}
  for run_fn, sync, _, _ in sides.values():
    for _ in range(warmup):
      sync(run_fn())
  times = {name: [] for name in sides}
  per_round = {name: [] for name in sides}
  for _ in range(rounds):
    for name, (run_fn, sync, _, _) in sides.items():
      ts = timing.time_steps(run_fn, sync, steps)
      times[name] += ts
      per_round[name].append(float(np.median(ts)))
  return {
      "config": base_name, "set": base_sets, "mesh": mesh_lib.describe(dict(mesh.shape)), "devices": mesh.size,
      "device_kind": mesh.devices.flat[0].device_kind, "steps": steps, "warmup": warmup, "rounds": rounds,
      "variants": {name: {"set": sets, "compile_s": sides[name][2], "step_time_s": timing.stats(times[name]),
                          "round_medians_s": per_round[name], "compiled_memory_per_device": sides[name][3]}
                   for name, sets in variants},
  }


def table(rep: dict) -> str:
  L = [f"jaxtrain.bench --compare: {rep['config']} {' '.join(rep['set'])} on {rep['mesh']} "
       f"({rep['devices']} x {rep['device_kind']}), {rep['steps']} steps x {rep['rounds']} alternating round(s)",
       f"{'variant':<16} {'step ms: median [min..max]':<30} {'round medians ms':<28} {'temp MiB/dev':>12} "
       f"{'compile s':>9}"]
  for name, v in rep["variants"].items():
    st, mem = v["step_time_s"], v["compiled_memory_per_device"]
    temp = "n/a" if mem is None else f"{mem['temp_bytes'] / 2**20:.2f}"
    rounds = " ".join(f"{x * 1e3:.0f}" for x in v["round_medians_s"])
    L.append(f"{name:<16} {st['median'] * 1e3:.1f} [{st['min'] * 1e3:.1f}..{st['max'] * 1e3:.1f}]".ljust(48)
             + f"{rounds:<28} {temp:>12} {v['compile_s']:>9.1f}")
  return "\n".join(L)
