"""Where MoE tokens sit during dispatch (`moe_batch`/`moe_length` of the rules), the data-defined
capacity groups (G consecutive positions, on one device) and the buffer sizes: one answer for the
layer, the config check and the traffic estimate. Imports parallel.sharding, core."""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from jaxtrain.parallel import sharding
from jaxtrain.core.errors import UserError

AXES = ("moe_batch", "moe_length", None)


def token_spec(mesh, B: int, L: int, rules=sharding.RULES) -> P:
  """PartitionSpec of (B, L, any) token arrays inside the dispatch (the plan passes its rules)."""
  return sharding.spec_for(AXES, (B, L, 1), mesh, rules=rules)


def dispatch_mesh(plan):
  """The mesh of the all_to_all dispatch, or None for one local group set."""
  return plan.mesh if plan.moe == "all_to_all" else None


def local_shape(mesh, B: int, L: int) -> tuple[int, int]:
  """(rows, positions) of one microbatch that one device holds during dispatch."""
  if mesh is None:
    return B, L
  spec = token_spec(mesh, B, L)
  return B // sharding.ways(spec[0], mesh), L // sharding.ways(spec[1], mesh)


def group_size(m, L: int) -> int:
  return m.moe_group_size or L


def group_fits(G: int, L: int, b: int, n: int) -> bool:
  """A group lies on one device holding b rows x n positions: G divides n, or n = L and G is a
  multiple of L dividing b*L."""
  return n % G == 0 or (n == L and G % L == 0 and (b * L) % G == 0)


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
  """Slots per expert and group: ceil(factor * G * k / X); factor 0 = G (never overflows)."""
  if factor == 0:
    return tokens
  return max(1, math.ceil(factor * tokens * top_k / experts))


def dropless_bound(tokens: int, experts: int, top_k: int, ep: int) -> int:
  """Rows one device sends to one expert-parallel peer, exact: a token picks distinct experts."""
  return tokens * min(top_k, experts // ep)


def check(cfg, mesh) -> None:
  """The capacity groups must fit the layout on this mesh (UserError otherwise)."""
  m, t = cfg.model, cfg.train
  if not m.moe_experts or m.moe_dropless:
    return
  B, L = t.batch_size // t.microbatches, t.seq_len
  b, n = local_shape(mesh, B, L)
  G = group_size(m, L)
  if not group_fits(G, L, b, n):
    where = f"each device holds {b} row(s) x {n} position(s) of a microbatch on this mesh"
    raise UserError(f"model.moe_group_size={m.moe_group_size} (G={G} tokens): {where}; G must divide {n}"
                    + (f", or be a multiple of train.seq_len={L} dividing {b * L}" if n == L else ""))


def buffer_rows(cfg, mesh) -> dict:
  """Per device, microbatch and MoE layer: tokens, and the rows each of the dispatch's
  all-to-alls moves (capacity: X * groups * C; dropless: ep * bound)."""
  m, t = cfg.model, cfg.train
  B, L = t.batch_size // t.microbatches, t.seq_len
  b, n = local_shape(mesh, B, L)
  T, X, k = b * n, m.moe_experts, m.moe_top_k
  ep = mesh.shape["expert"]
  if m.moe_dropless:
    return {"tokens": T, "rows": ep * dropless_bound(T, X, k, ep), "kind": "dropless exchange"}
  G = group_size(m, L)
  return {"tokens": T, "rows": X * (T // G) * capacity(G, X, k, m.moe_capacity_factor), "kind": "capacity buffers"}
