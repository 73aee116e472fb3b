"""Where MoE tokens sit during dispatch (`moe_batch`/`moe_length`), the capacity groups (G consecutive
positions on one device) and buffer sizes: one answer for the layer, the config check and the traffic."""

from __future__ import annotations


from jax.sharding import PartitionSpec as P

from jaxtrain.core.errors import UserError
from jaxtrain.model.moe import capacity, group_fits
from jaxtrain.parallel import sharding

AXES = ("moe_batch", "moe_length", None)


def token_spec(mesh, B: int, L: int, rules=sharding.RULES) -> P:
  """PartitionSpec of (B, L, any) token arrays inside the dispatch (the plan passes its rules)."""
  return sharding.spec_for(AXES, (B, L, 1), mesh, rules=rules)


def dispatch_mesh(plan):
  """The mesh of the all_to_all dispatch, or None for one local group set."""
  return plan.mesh if plan.moe == "all_to_all" else None


def local_shape(cfg, mesh) -> tuple[int, int]:
  """(rows, positions) of one microbatch that one device holds during dispatch."""
  B, L = cfg.train.batch_size // cfg.train.microbatches, cfg.train.seq_len
  spec = token_spec(mesh, B, L)
  return B // sharding.ways(spec[0], mesh), L // sharding.ways(spec[1], mesh)


def dropless_bound(tokens: int, experts: int, top_k: int, ep: int) -> int:
  """Rows one device sends to one expert-parallel peer, exact: a token picks distinct experts."""
  return tokens * min(top_k, experts // ep)


def check(cfg, mesh) -> None:
  """The capacity groups must fit the layout on this mesh (UserError otherwise)."""
  m, L = cfg.model, cfg.train.seq_len
  if not m.moe_experts or m.moe_dropless:
    return
  b, n = local_shape(cfg, mesh)
  G = m.moe_group_size or L
  if not group_fits(G, L, b, n):
    where = f"each device holds {b} row(s) x {n} position(s) of a microbatch on this mesh"
    raise UserError(f"model.moe_group_size={m.moe_group_size} (G={G} tokens): {where}; G must divide {n}"
                    + (f", or be a multiple of train.seq_len={L} dividing {b * L}" if n == L else ""))


def buffer_rows(cfg, mesh) -> dict:
  """Per device, microbatch and MoE layer: tokens, and the rows each dispatch all-to-all moves."""
  m = cfg.model
  b, n = local_shape(cfg, mesh)
  T, X, k = b * n, m.moe_experts, m.moe_top_k
  ep = mesh.shape["expert"]
  if m.moe_dropless:
    return {"tokens": T, "rows": ep * dropless_bound(T, X, k, ep), "kind": "dropless exchange"}
  G = m.moe_group_size or cfg.train.seq_len
  return {"tokens": T, "rows": X * (T // G) * capacity(G, X, k, m.moe_capacity_factor), "kind": "capacity buffers"}
