"""`python -m jaxtrain.bench --compare NAME[@MESH]:k=v,k=v ...`: variants of one config (--config, --set, plus
each variant's overrides) on the same batches, each on the bench's mesh or its own MESH (same device count: layouts
compared), timed in one process, alternating round by round; per variant: step times, round medians, compile time
and XLA's compiled memory per device."""

from __future__ import annotations

import math

from jaxtrain.core import parse as parse_lib
from jaxtrain.core.errors import UserError


def parse(items: list[str]) -> list[tuple[str, list[str]]]:
  """['name:k=v,k=v', ...] -> [(name, ['k=v', ...])]; a name may carry its mesh, 'name@data=2,fsdp=4' (see mesh)."""
  out = []
  for item in items:
    name, colon, sets = item.partition(":")
    if not colon or not name.strip() or name.strip().startswith("@"):
      raise UserError(f"--compare {item!r} must look like NAME[@MESH]:section.key=value[,section.key=value...]")
    out.append((name.strip(), parse_lib.items(sets, f"--compare {name.strip()}:")))
  names = [n.partition("@")[0].strip() for n, _ in out]
  if len(set(names)) != len(names):
    raise UserError(f"--compare names must differ: {', '.join(names)}")
  return out


def variant_mesh(name: str, default):
  """(variant name, its mesh): the MESH of 'name@MESH' (axis=size pairs or a preset, the devices of the bench's mesh,
  a size -1 filling them), else `default`; a mesh over another device count is refused in one line."""
  from jaxtrain.parallel import mesh as mesh_lib
  short, at, spec = name.partition("@")
  if not at:
    return name, default
  sizes, dcn = mesh_lib.parse_full(spec.strip())
  devices = list(default.devices.flat)
  if -1 not in sizes.values() and math.prod(sizes.values()) != len(devices):
    raise UserError(f"--compare {name}: the mesh {spec.strip()!r} spans {math.prod(sizes.values())} devices "
                    f"but the bench's --mesh spans {len(devices)}: variants are timed on the same devices")
  return short.strip(), mesh_lib.build(sizes, devices, dcn=dcn, simulate_hosts=True)


def _variant(name, cfg, mesh, batches, first: dict, segments: int):
  """A timed side and its compiled memory. `first` holds the first variant's initial state on
  the host: a variant whose state has the same shapes starts from it (same weights, one
  initializer compile fewer)."""
  import jax
  from jaxtrain.analysis import gpu_compile, speed
  from jaxtrain.run import step as step_lib
  setup = step_lib.Setup(cfg, mesh, segments=segments)
  cfg = setup.cfg  # with what the mesh implies
  sig = lambda tree: (jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)])  # noqa: E731
  if "state" in first and sig(first["state"]) == sig(jax.eval_shape(setup.init)):
    state = jax.device_put(first["state"], setup.state_shardings)
  else:
    state = setup.init()
    first.setdefault("state", jax.device_get(state))
  side = speed.jaxtrain_side(cfg, setup, batches, state)
  side.name = name
  m = gpu_compile.CompiledMemory.of(side.box["compiled"])
  return side, m and {"temp_bytes": m.temporaries, "argument_bytes": m.arguments, "output_bytes": m.outputs,
                      "alias_bytes": m.aliased, "code_bytes": m.generated_code}


def run(base_name: str, base_sets: list[str], variants: list[tuple[str, list[str]]], mesh, *, steps: int,
        warmup: int, rounds: int) -> dict:
  from jaxtrain import data
  from jaxtrain.analysis import speed
  from jaxtrain.core import config
  from jaxtrain.parallel import mesh as mesh_lib
  from jaxtrain.run import step as step_lib
  meshes = dict(variant_mesh(name, mesh) for name, _ in variants)
  variants = [(name.partition("@")[0].strip(), sets) for name, sets in variants]
  cfgs = {name: config.load(base_name, base_sets, then=sets) for name, sets in variants}
  cfg0 = next(iter(cfgs.values()))
  segments = data.most_segments(cfg0, min(steps, 4))
  batches = speed.first_batches(cfg0, step_lib.Setup(cfg0, mesh, segments=segments), min(steps, 4), unpacked=False)
  first: dict = {}
  sides = {name: _variant(name, cfg, meshes[name], batches, first, segments) for name, cfg in cfgs.items()}
  medians = speed.alternate([s for s, _ in sides.values()], steps=steps, warmup=warmup, rounds=rounds)
  return {
      "config": base_name, "set": base_sets, "mesh": mesh_lib.describe(dict(mesh.shape)), "devices": mesh.size,
      "device_kind": mesh.devices.flat[0].device_kind, "steps": steps, "warmup": warmup, "rounds": rounds,
      "variants": {name: {"set": sets, "mesh": mesh_lib.describe(dict(meshes[name].shape)),
                          "compile_s": sides[name][0].compile_s, "step_time_s": speed.stats(sides[name][0].times),
                          "round_medians_s": medians[name],
                          "compiled_memory_per_device": sides[name][1]} for name, sets in variants},
  }


def table(rep: dict) -> str:
  labels = {name: name if v.get("mesh", rep["mesh"]) == rep["mesh"] else f"{name} ({v['mesh']})"
            for name, v in rep["variants"].items()}
  w = max(16, *map(len, labels.values()))
  L = [f"jaxtrain.bench --compare: {rep['config']} {' '.join(rep['set'])} on {rep['mesh']} "
       f"({rep['devices']} x {rep['device_kind']}), {rep['steps']} steps x {rep['rounds']} alternating round(s)",
       f"{'variant':<{w}} {'step ms: median [min..max]':<30} {'round medians ms':<28} {'temp MiB/dev':>12} "
       f"{'compile s':>9}"]
  for name, v in rep["variants"].items():
    st, mem = v["step_time_s"], v["compiled_memory_per_device"]
    temp = "n/a" if mem is None else f"{mem['temp_bytes'] / 2**20:.2f}"
    rounds = " ".join(f"{x * 1e3:.0f}" for x in v["round_medians_s"])
    spread = f"{st['median'] * 1e3:.1f} [{st['min'] * 1e3:.1f}..{st['max'] * 1e3:.1f}]"
    L.append(f"{labels[name]:<{w}} {spread:<31}" + f"{rounds:<28} {temp:>12} {v['compile_s']:>9.1f}")
  return "\n".join(L)
