"""The ONE rules table from logical axis names to mesh axes, and the code that applies it.

The model names logical axes only. Parallelizing differently means editing RULES.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# logical axis -> mesh axes it is split over (in order). Absent or () = replicated.
RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": ("data", "fsdp", "expert"),  # expert shards the batch outside MoE layers
    "length": ("sequence",),
    "act_length": ("sequence",),  # length of the residual stream (norms, residual adds)
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_kv_heads": ("tensor",),
    "act_mlp": ("tensor",),
    "act_vocab": ("tensor",),
    "act_experts": ("expert",),
    # parameters: stored FSDP-sharded on `embed`, Megatron-sharded on heads/mlp/vocab
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "experts": ("expert",),
    "vocab": ("tensor",),
    "norm": (),
}


# Megatron sequence parallelism (train.sequence_parallel): the residual stream between
# tensor-parallel regions is split along its length over `tensor` as well, so XLA turns
# each TP region's closing all-reduce into a reduce-scatter and opens the next with an
# all-gather.
SEQUENCE_PARALLEL_RULES: dict[str, tuple[str, ...]] = {"act_length": ("sequence", "tensor")}

# Rule overrides in force while tracing (set with `active_mesh`).
_OVERRIDES: contextvars.ContextVar[dict] = contextvars.ContextVar("jaxtrain_rule_overrides", default={})


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh, notes: list[str] | None = None,
             where: str = "") -> P:
  """PartitionSpec for logical `axes` of an array of `shape` on `mesh`.

  A mesh axis is dropped (that dimension replicated over it) when it does not divide
  the dimension or was already used by an earlier dimension; each drop is noted.
  """
  used: set[str] = set()
  out = []
  rules = {**RULES, **_OVERRIDES.get()}
  for name, dim in zip(axes, shape, strict=True):
    chosen = []
    for mesh_axis in rules.get(name, ()) if name else ():
      size = mesh.shape[mesh_axis]
      if size == 1 or mesh_axis in used:
        continue
      if (dim // math.prod(mesh.shape[a] for a in chosen)) % size:
        if notes is not None:
          notes.append(f"{where or name}: {name}={dim} not divisible by {mesh_axis}={size}; replicated over {mesh_axis}")
        continue
      chosen.append(mesh_axis)
    used.update(chosen)
    out.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
  return P(*out)


def param_shardings(abstract_state, mesh, notes: list[str] | None = None):
  """NamedShardings for every parameter of an abstract nnx.State, from its `axes` metadata.

  Returns a pure dict mirroring `nnx.to_pure_dict(state)`.
  """
  from flax import nnx

  def one(path, var):
    axes = var.get_metadata().get("axes")
    if axes is None:
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical axes")
    where = "/".join(str(getattr(k, "key", k)) for k in path)
    return NamedSharding(mesh, spec_for(axes, var.shape, mesh, notes, where))

  shardings = jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(shardings)


def logical_sharding(mesh, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
  return NamedSharding(mesh, spec_for(axes, shape, mesh))


# The mesh that `constrain` annotates against; None outside a sharded trace.
_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxtrain_mesh", default=None)


@contextlib.contextmanager
def active_mesh(mesh, sequence_parallel: bool = False):
  token = _MESH.set(mesh)
  rules = _OVERRIDES.set(SEQUENCE_PARALLEL_RULES if sequence_parallel else {})
  try:
    yield
  finally:
    _OVERRIDES.reset(rules)
    _MESH.reset(token)


def current_mesh():
  """The mesh of the sharded trace in progress, or None."""
  return _MESH.get()


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Annotates an activation with logical axes; a no-op when no mesh is active."""
  mesh = _MESH.get()
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_sharding(mesh, axes, x.shape))
