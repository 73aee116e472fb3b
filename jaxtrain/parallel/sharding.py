"""The rules table (logical axis -> mesh axes) and its use: specs, parameter shardings, split counts, shard_map."""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.core.errors import UserError

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
    # MoE dispatch (expert_layout): whole sequences per device where the batch allows
    "moe_batch": ("data", "fsdp", "expert", "sequence"),
    "moe_length": ("sequence",),  # only when the rows cannot take `sequence`
    # parameters: stored FSDP-sharded on `embed`, Megatron-sharded on heads/mlp/vocab; `expert` too where the
    # tensor's `experts` dimension does not take it (dense weights and their Adam state not replicated over it)
    "embed": ("fsdp", "expert"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "experts": ("expert",),
    "vocab": ("tensor",),
    "norm": (),
    "sinks": (),  # a logit per query head: attention kernels take their heads' share where they split them
    "layers": ("pipeline",),  # the stacked-blocks axis of model.scan_layers: a pipeline stage holds its slice
}

# (logical axis, mesh axis) pairs that split only where they divide: elsewhere the dimension stays replicated over
# that axis, as it was before the axis joined the rule (so a d_model that fsdp splits never becomes an error).
OPTIONAL = {("embed", "expert")}


def rules_for(sequence_parallel: bool) -> dict[str, tuple[str, ...]]:
  """Megatron-SP (run.sequence_parallel) splits the residual stream's length over `tensor` too."""
  return {**RULES, "act_length": ("sequence", "tensor")} if sequence_parallel else dict(RULES)


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh, notes: list[str] | None = None,
             where: str = "", rules: dict[str, tuple[str, ...]] = RULES) -> P:
  """PartitionSpec of logical `axes` on `mesh`: a mesh axis splits a dimension it divides; a smaller one dividing it
  is replicated (noted); else Indivisible. An unknown logical name is a KeyError."""
  used, out = set(), []
  for name, dim in zip(axes, shape, strict=True):
    if name is not None and name not in rules:
      raise KeyError(f"logical axis {name!r} (at {where or axes}) is not in sharding.RULES: {', '.join(rules)}")
    chosen = []
    for mesh_axis in rules[name] if name else ():
      size = mesh.shape[mesh_axis]
      if size == 1 or mesh_axis in used:
        continue
      left = dim // math.prod(mesh.shape[a] for a in chosen)
      if left % size:
        if size % left and (name, mesh_axis) not in OPTIONAL:
          raise Indivisible(where or name, name, left, mesh_axis, size)
        if notes is not None:
          notes.append(f"{where or name}: {name}={left} is smaller than {mesh_axis}={size}; "
                       f"replicated over {mesh_axis} (every {mesh_axis} shard keeps all {left})")
        continue
      chosen.append(mesh_axis)
    used.update(chosen)
    out.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
  return P(*out)


def sizes_that_fit(dims, limit: int) -> list[int]:
  """Mesh axis sizes up to `limit` that split or evenly replicate every one of `dims`."""
  return [n for n in range(1, limit + 1) if all(d % n == 0 or n % d == 0 for d in dims)]


class Indivisible(UserError):
  """A dimension that a mesh axis can neither split nor evenly replicate."""

  def __init__(self, where: str, name: str, dim: int, mesh_axis: str, size: int):
    self.where, self.name, self.dim, self.mesh_axis, self.size = where, name, dim, mesh_axis, size
    fits = sizes_that_fit([dim], max(64, 2 * size))
    super().__init__(f"{where}: {name}={dim} cannot be split over {mesh_axis}={size}; "
                     f"{mesh_axis} sizes that work: {', '.join(map(str, fits))}")


def param_shardings(abstract_state, mesh, notes: list[str] | None = None):
  """NamedShardings (a pure dict) of an abstract nnx.State from its `axes`; one UserError for what cannot split."""
  from flax import nnx
  failed: list[Indivisible] = []
  dims: dict[str, list[int]] = {}  # mesh axis -> every dimension the rules split over it

  def one(path, var):
    axes = var.get_metadata().get("axes")
    if axes is None:
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has no logical axes")
    for name, dim in zip(axes, var.shape):
      for mesh_axis in RULES.get(name, ()) if name else ():
        dims.setdefault(mesh_axis, []).append(dim)
    where = "/".join(str(getattr(k, "key", k)) for k in path)
    try:
      return NamedSharding(mesh, spec_for(axes, var.shape, mesh, notes, where))
    except Indivisible as e:
      failed.append(e)
      return None

  shardings = jax.tree_util.tree_map_with_path(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  if failed:
    axis, size = failed[0].mesh_axis, failed[0].size
    bad = [e for e in failed if e.mesh_axis == axis]
    by_dim: dict[tuple[str, int], list[str]] = {}
    for e in bad:
      by_dim.setdefault((e.name, e.dim), []).append(e.where)
    named = ", ".join(f"{n}={d} ({w[0]}" + (f" and {len(w) - 1} more)" if len(w) > 1 else ")")
                      for (n, d), w in by_dim.items())
    fits = sizes_that_fit(dims[axis], max(64, 2 * size))
    raise UserError(f"{axis}={size} can neither split nor evenly replicate {named}; {axis} sizes that work for "
                    f"every parameter: {', '.join(map(str, fits))}")
  return nnx.to_pure_dict(shardings)


def logical_sharding(mesh, axes: tuple[str | None, ...], shape: tuple[int, ...], rules=RULES) -> NamedSharding:
  return NamedSharding(mesh, spec_for(axes, shape, mesh, rules=rules))


def axes_of(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a mesh axis, or a tuple of them)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def ways(entry, mesh) -> int:
  """How many devices split a dimension whose PartitionSpec entry is `entry`."""
  return math.prod(mesh.shape[a] for a in axes_of(entry)) if mesh is not None else 1


def axis_ways(name: str, dim: int, mesh) -> int:
  """How many ways the rules table splits a dimension of logical axis `name` on `mesh`."""
  return ways(spec_for((name,), (dim,), mesh)[0], mesh) if mesh is not None else 1


def tokens_per_device(cfg, mesh) -> int:
  """Tokens of one microbatch on one device: rows over the batch axes, length over sequence."""
  t = cfg.train
  rows = t.batch_size // t.microbatches
  return rows // axis_ways("batch", rows, mesh) * (t.seq_len // axis_ways("length", t.seq_len, mesh))


def slices_first(src: P, dst: P) -> P:
  """The layout on the way from `src` to `dst` that `src` reaches by local slicing alone: `dst`'s splits over the
  mesh axes `src` leaves replicated, and `src`'s splits where they are. From there one all-to-all moves `src`'s
  splits to where `dst` wants them. Straight from `src`, XLA's SPMD partitioner replicates the whole array and
  slices it ("Involuntary full rematerialization") where an axis that stays replicated orders before the moved
  one (pipeline's: the embedded tokens, from d_model split over fsdp to rows split over fsdp and tensor)."""
  n = max(len(src), len(dst))
  src, dst = (tuple(s) + (None,) * (n - len(s)) for s in (src, dst))
  held = {a for e in src for a in axes_of(e)}
  out = []
  for s, d in zip(src, dst):
    axes = tuple(a for a in axes_of(d) if a not in held) + axes_of(s)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def manual(fn, mesh, in_specs, out_specs, **kw):
  """jax.shard_map with check_vma=False: replicated values meet varying ones; the transpose accounts for it untyped."""
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **kw)


def storage_sharding(sh: NamedSharding, shape: tuple[int, ...], over_data: bool, memory_kind: str | None = None,
                     notes: list[str] | None = None, where: str = "", stacked: bool = False) -> NamedSharding:
  """Where the fp32 master and Adam moments of a parameter computed with sharding `sh` live: ZeRO-1/2
  (`over_data`) also split them over `data`, on the fsdp-sharded dimension if `data` divides what is
  left of it, else the largest one it divides (never a scanned layer stack's leading axis, `stacked`, which each
  layer slices; none: replicated over data, noted); offload puts them in `memory_kind` (pinned_host)."""
  spec = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
  data = sh.mesh.shape.get("data", 1)
  if over_data and data > 1:
    left = [shape[i] // ways(spec[i], sh.mesh) for i in range(len(shape))]
    order = sorted(range(int(stacked), len(shape)), key=lambda i: ("fsdp" not in axes_of(spec[i]), -left[i]))
    fit = [i for i in order if left[i] % data == 0]
    if fit:
      entry = ("data", *axes_of(spec[fit[0]]))
      spec[fit[0]] = entry if len(entry) > 1 else entry[0]
    elif notes is not None:
      notes.append(f"{where}: no dimension of {shape} divides over data={data}; its optimizer state is replicated")
  return NamedSharding(sh.mesh, P(*spec), memory_kind=memory_kind)
