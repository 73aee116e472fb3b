"""Which mesh axes each collective of a compiled step runs over, from its replica groups: the bytes per step on
each axis (`data` crosses hosts on a pod; its bytes per update are what gradient accumulation must not multiply)."""

from __future__ import annotations

import collections
import re

import numpy as np

from jaxtrain.analysis.gpu_compile import Hlo, collective_ops

_IOTA = re.compile(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
# mesh['axis_0'=2,...], optionally device_ids=([2,2]T(1,0)), then the group's axes {'axis_0'}
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?)\))? \{([^}]*)\}")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _iota(shape: str, dims: str, perm: str | None) -> np.ndarray:
  ids = np.arange(np.prod(_ints(dims))).reshape(_ints(dims))
  return (ids.transpose(_ints(perm)) if perm else ids).reshape(_ints(shape))


def first_group(rest: str) -> list[int] | None:
  """The device ids (partition ids) of a collective's first replica group; None where the text has none."""
  m = _MESH.search(rest)
  if m:  # a named reshape of the devices; the group varies along the listed axes
    names = [x.split("=")[0].strip("' ") for x in m.group(1).split(",")]
    sizes = [int(x.split("=")[1]) for x in m.group(1).split(",")]
    ids = np.arange(np.prod(sizes))
    if m.group(2):
      d = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", m.group(2).strip())
      ids = _iota(str(np.prod(sizes)), d.group(1), d.group(2)) if d else ids
    grid = ids.reshape(sizes)
    along = {a.strip("' ") for a in m.group(3).split(",") if a.strip("' ")}
    index = tuple(slice(None) if n in along else 0 for n in names)
    return [int(x) for x in grid[index].flatten()]
  m = re.search(r"replica_groups=" + _IOTA.pattern, rest)
  if m:
    return [int(x) for x in _iota(m.group(1), m.group(2), m.group(3))[0]]
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
  if m:
    return _ints(m.group(1))
  m = re.search(r"source_target_pairs=\{\{(\d+),(\d+)\}", rest)
  return [int(m.group(1)), int(m.group(2))] if m else None


def axes_of(group: list[int] | None, mesh_shape: dict[str, int]) -> tuple[str, ...]:
  """The mesh axes along which the group's devices differ (partition id = position in the mesh's device array)."""
  if not group or len(group) < 2:
    return ()
  coords = np.array(np.unravel_index(group, tuple(mesh_shape.values()))).T
  return tuple(a for i, a in enumerate(mesh_shape) if len(set(coords[:, i])) > 1)


def bytes_by_axes(hlo: Hlo, mesh_shape: dict[str, int]) -> dict[str, dict[str, int]]:
  """{"data" | "fsdp+data" | ...: {collective kind: bytes per step}} (bytes as `collectives` counts them)."""
  out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for i, kind, size, n in collective_ops(hlo):
    out["+".join(axes_of(first_group(i.rest), mesh_shape)) or "none"][kind] += n * size
  return {k: dict(v) for k, v in out.items()}


def over(by_axes: dict[str, dict[str, int]], axis: str) -> int:
  """Bytes per step of the collectives whose groups span `axis` (alone or with other axes)."""
  return sum(sum(kinds.values()) for key, kinds in by_axes.items() if axis in key.split("+"))
