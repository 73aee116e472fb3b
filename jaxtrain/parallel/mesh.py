"""The device mesh: `--mesh` parsing, simulated CPU devices, the Mesh (`tensor` innermost, `pipeline` outermost)."""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path

from jaxtrain.core import parse as parse_lib, resources
from jaxtrain.core.errors import UserError

MAX_SIMULATED = 4096  # simulated CPU devices take seconds per thousand to create, and memory
AXES = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")
ALIASES = {"pp": "pipeline", "dp": "data", "fsdp": "fsdp", "ep": "expert", "sp": "sequence", "tp": "tensor"}


def _axis(name: str) -> str:
  if (axis := ALIASES.get(name.strip(), name.strip())) in AXES:
    return axis
  valid = ", ".join(f"{a} ({k})" if k != a else a for k, a in ALIASES.items())
  raise UserError(f"unknown mesh axis {name!r}; valid axes: {valid}")


def _size(given: str, text: str) -> int:
  """A size: a positive integer in ASCII digits (the one integer reading, core/parse.py), or -1."""
  text = text.strip()
  try:
    size = parse_lib.integer(text)
  except ValueError:
    size = 0
  if size == -1 or size >= 1:
    return size
  ascii_only = "" if text.isascii() else "; an integer is written in ASCII digits (0-9)"
  raise UserError(f"mesh {given.strip()}={text}: size must be a positive integer (or -1 for one axis to fill the "
                  f"rest){ascii_only}")


def preset_names() -> list[str]:
  return resources.names("meshes")


def _from_preset(path: Path) -> str:
  try:
    doc = tomllib.loads(path.read_text())
  except tomllib.TOMLDecodeError as e:
    raise UserError(f"mesh preset {str(path)!r} is not valid TOML: {e}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"mesh preset {str(path)!r} cannot be read: {e}") from None
  axes, dcn = doc.get("axes"), doc.get("dcn", {})
  if not isinstance(axes, dict) or not isinstance(dcn, dict) or set(doc) - {"axes", "dcn", "description"}:
    raise UserError(f"mesh preset {str(path)!r} must hold an [axes] table (optionally [dcn] and a description)")
  for table, prefix in ((axes, ""), (dcn, "dcn.")):
    for k, v in table.items():  # TOML integers only: "2", 2.0 and true are not sizes
      if not isinstance(v, int) or isinstance(v, bool):
        raise UserError(f"mesh preset {str(path)!r}: {prefix}{k} = {v!r} is not a size; write an integer "
                        "(e.g. data = 2)")
  return ",".join([f"{k}={v}" for k, v in axes.items()] + [f"dcn.{k}={v}" for k, v in dcn.items()])


def parse_full(spec: str) -> tuple[dict[str, int], dict[str, int]]:
  """`dp=8,tp=8[,dcn.dp=4]` or a preset -> (sizes of the six axes, cross-host factor of each: dcn.AXIS=K)."""
  if "=" not in (spec := spec.strip()):
    path = Path(spec) if spec.endswith(".toml") else resources.find("meshes", spec)
    if path is None or not path.is_file():
      raise UserError(f"mesh {spec!r} is neither axis=size pairs (e.g. dp=8,tp=8) nor a preset; presets: {', '.join(preset_names())}")
    spec = _from_preset(path)
  sizes, dcn = {}, {}  # axis -> size; axis -> cross-host factor
  for part in parse_lib.items(spec, "--mesh"):
    name, eq, value = part.partition("=")
    if not eq:
      raise UserError(f"mesh entry {part!r} must look like axis=size (e.g. dp=8,tp=8)")
    table = dcn if name.strip().startswith("dcn.") else sizes
    axis = _axis(name.strip().removeprefix("dcn."))
    if axis in table:
      raise UserError(f"mesh axis {axis!r} is given twice in {spec!r}")
    table[axis] = _size(name, value)
  if list(sizes.values()).count(-1) > 1:
    raise UserError(f"mesh {spec!r} has more than one -1; at most one axis may fill the rest")
  for axis, k in dcn.items():
    if k == -1 or sizes.get(axis, 1) == -1 or sizes.get(axis, 1) % k:
      raise UserError(f"mesh dcn.{axis}={k} must divide {axis}={sizes.get(axis, 1)} (both given explicitly)")
  return {a: sizes.get(a, 1) for a in AXES}, {a: dcn.get(a, 1) for a in AXES}


def parse(spec: str) -> dict[str, int]:
  """`dp=8,tp=8` (or a preset name/path) -> sizes of all six axes; -1 kept for `fill`."""
  return parse_full(spec)[0]


def fill(sizes: dict[str, int], device_count: int) -> dict[str, int]:
  """Resolves a -1 against the device count and checks the product."""
  known = math.prod(s for s in sizes.values() if s != -1)
  if -1 in sizes.values():
    if device_count % known:
      raise UserError(f"mesh cannot fill -1: the other axes multiply to {known}, which does not divide the {device_count} devices")
    sizes = {a: (device_count // known if s == -1 else s) for a, s in sizes.items()}
  total = math.prod(sizes.values())
  if total != device_count:
    raise UserError(f"mesh {describe(sizes)} needs {total} devices but {device_count} are available")
  return sizes


def describe(sizes: dict[str, int]) -> str:
  return ",".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "single device"


def has_accelerator_plugin() -> bool:
  """True if a GPU/TPU PJRT plugin is installed; decided without starting a JAX backend."""
  import importlib.util
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms:
    return any(p not in ("cpu", "") for p in platforms.split(","))
  return any(importlib.util.find_spec(m) is not None
             for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu", "jax_rocm60_plugin", "jax_rocm7_plugin"))


def provide_cpu_devices(count: int) -> None:
  """Asks JAX for `count` CPU devices before the backend starts (unless the user chose a count). Also with a GPU
  plugin installed: without a GPU, JAX falls back to the CPU (on a GPU machine the CPU count goes unused)."""
  import jax
  if (count <= 1 or os.environ.get("JAX_NUM_CPU_DEVICES")
      or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")):
    return
  if count > MAX_SIMULATED:
    raise UserError(f"the mesh needs {count} devices: at most {MAX_SIMULATED} CPU devices can be simulated")
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:
    pass  # backend already running (e.g. inside tests); `build` reports any shortfall


def build(sizes: dict[str, int], devices=None, dcn: dict[str, int] | None = None, simulate_hosts: bool = False):
  """A Mesh of the six axes (with `dcn`, each is across x within processes); Auto axis types, as orbax/flax assume.
  `simulate_hosts`: one process stands for all the hosts (inspect), the dcn factors then only order devices."""
  import jax
  import numpy as np
  from jax.experimental import mesh_utils
  from jax.sharding import AxisType, Mesh
  devices = list(devices) if devices is not None else jax.devices()
  sizes = fill(sizes, len(devices))
  shape = tuple(sizes[a] for a in AXES)
  types = (AxisType.Auto,) * len(AXES)
  dcn_shape = tuple((dcn or {}).get(a, 1) for a in AXES)
  if math.prod(dcn_shape) == 1:
    return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
  hosts = len({d.process_index for d in devices})
  if hosts == 1 and simulate_hosts:
    return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
  if math.prod(dcn_shape) != hosts:
    raise UserError(f"mesh dcn factors multiply to {math.prod(dcn_shape)} but the run has {hosts} host(s) (processes)")
  ici_shape = tuple(s // k for s, k in zip(shape, dcn_shape))
  grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices, process_is_granule=True)
  return Mesh(np.asarray(grid), AXES, axis_types=types)


def setup(spec: str):
  """Parses the spec, provides simulated devices if needed, and builds the mesh."""
  sizes, dcn = parse_full(spec)
  if -1 not in sizes.values():
    provide_cpu_devices(math.prod(sizes.values()))
  return build(sizes, dcn=dcn)
