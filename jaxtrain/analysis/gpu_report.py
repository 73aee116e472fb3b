"""inspect's side of `--device KIND --compile`: which mesh to compile for, and the text
lines for what the compiled program shows (see jaxtrain.analysis.gpu_compile)."""

from __future__ import annotations

import sys

from jaxtrain.analysis import memory
from jaxtrain.core.errors import UserError


def target_mesh(device: str | None, spec: str, compile: bool, device_memory: str | None):
  """(mesh, --device-memory value) for inspect.

  --device KIND (any name of the device table, jaxtrain.parallel.devices) sets the memory verdict
  to the kind's memory unless --device-memory says otherwise; the bill is for the kind's
  kernels either way (inspect builds the kind's plan). For a kind with an XLA:GPU target
  (gpu_compile.KINDS) and the CUDA plugin: compile-only devices of that kind (the host
  backend is pinned to CPU first, so no CUDA backend is started). Otherwise the simulated
  CPU devices as without --device; with --compile then one line on stderr, and the
  compiled section is labelled XLA:CPU (--compile for a kind without a target: an error)."""
  from jaxtrain.parallel import devices
  from jaxtrain.analysis import gpu_compile
  from jaxtrain.parallel import mesh as mesh_lib
  if device is None:
    return mesh_lib.setup(spec), device_memory
  key, _ = devices.named(device)
  k = gpu_compile.find_kind(device)
  if compile and k is None:
    raise UserError(f"--compile --device {device}: XLA:GPU compile targets exist for {', '.join(gpu_compile.KINDS)} "
                    "only; drop --compile for the analytic bill of this device")
  device_memory = device_memory or key
  if k is not None and gpu_compile.plugin_installed():
    import jax
    jax.config.update("jax_platforms", "cpu")
    return gpu_compile.mesh(k, spec), device_memory
  if compile and k is not None:
    print(f"jaxtrain.inspect: no CUDA plugin installed (pip install 'jaxtrain[gpu-aot]'), so --compile uses XLA:CPU "
          f"on simulated CPU devices, not XLA:GPU for {k.name}", file=sys.stderr)
  return simulated(spec), device_memory


def simulated(spec: str):
  """The mesh on simulated CPU devices in this one process; dcn factors (hosts) only
  order devices, which the bill does not depend on, so they are dropped here."""
  import math
  from jaxtrain.parallel import mesh as mesh_lib
  sizes, _ = mesh_lib.parse_full(spec)
  if -1 not in sizes.values():
    mesh_lib.provide_cpu_devices(math.prod(sizes.values()))
  return mesh_lib.build(sizes)


def render(c: dict) -> list[str]:
  """Text lines for the collectives, cuDNN attention, cost analysis and roofline bound."""
  L = []
  att = c.get("cudnn_attention", {})
  if "attention" in c:
    L.append(f"  attention: {c['attention']['kernel']} ({c['attention']['reason']})")
  L.append(f"  cuDNN fused attention: {att.get('ops', 0)} custom call(s) in the program, {att.get('per_step', 0)} "
           "executed per step")
  if c.get("square_buffers"):
    L.append(f"  L x L buffers: {', '.join(c['square_buffers'][:4])}")
  L.append("  collectives (per device; bytes = larger side of each op, times executions per step):")
  for name, r in c.get("collectives", {}).items():
    if r["ops"]:
      L.append(f"    {name:<19} {r['ops']:>4} op(s), {r['per_step']:>5} per step, {memory.human(r['bytes_per_step']):>11} "
               f"per step, largest {memory.human(r['largest_bytes'])}; {r['async']} async, {r['sync']} sync")
  if not any(r["ops"] for r in c.get("collectives", {}).values()):
    L.append("    none")
  cost = c.get("cost") or {}
  if "flops" in cost:
    L.append(f"  XLA cost analysis (loop bodies x trip count): {cost['flops']:.4g} FLOPs, "
             f"{memory.human(cost['bytes_accessed'])} accessed per device per step")
  elif "error" in cost:
    L.append(f"  XLA cost analysis unavailable: {cost['error']}")
  roof = c.get("roofline")
  if roof:
    L.append(f"  roofline: step time >= {_secs(roof['seconds'])} ({roof['bound']}-bound; compute "
             f"{_secs(roof['compute_seconds'])}, memory {_secs(roof['memory_seconds'])}); a {roof['label']}")
  return L


def _secs(t: float) -> str:
  return f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us"
