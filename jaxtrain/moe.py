"""Mixture-of-experts routing, capacity, and expert-parallel dispatch/combine.

Routing (plain math, XLA-sharded like any activation): float32 router logits, softmax,
top-k experts per token, their weights renormalized to sum to 1. Two auxiliary losses,
both computed over all tokens of the microbatch (so they do not depend on the mesh):
  load balance  X * sum_e f_e * P_e   (f_e: share of the T*k assignments that chose e,
                                       P_e: mean router probability of e; 1 when uniform)
  router z-loss mean_t logsumexp(logits_t)^2

Capacity: tokens are routed in groups, a group being the tokens one device holds (all
tokens without a mesh). Each expert takes at most C = ceil(capacity_factor * T * k / X)
assignments of a group of T tokens; first choices are served before second choices,
earlier tokens before later ones. Assignments past C are dropped (they add nothing; the
residual stream carries the token) and counted. capacity_factor = 0 sizes C = T, so
nothing can drop.

Expert parallelism: with a mesh, dispatch and combine are `shard_map`s over the whole
mesh with an `all_to_all` over `expert`: each device scatters its tokens into per-expert
buffers (X, C, D), sends expert e's buffer to the device that owns e, and gets back the
outputs for its tokens. Between the two, the expert FFN is an ordinary einsum on
(X, tokens, D) buffers sharded over `expert` (so each device computes its own experts),
with FSDP/tensor sharding of the expert weights left to XLA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def route(x_BxLxD, router_DxX, top_k: int):
  """-> expert ids (B,L,k) int32, renormalized weights (B,L,k) f32, load-balance loss, z-loss."""
  X = router_DxX.shape[1]
  logits_BxLxX = jnp.einsum("bld,dx->blx", x_BxLxD.astype(jnp.float32), router_DxX.astype(jnp.float32))
  probs_BxLxX = jax.nn.softmax(logits_BxLxX, axis=-1)
  w_BxLxk, idx_BxLxk = jax.lax.top_k(probs_BxLxX, top_k)
  w_BxLxk = w_BxLxk / jnp.sum(w_BxLxk, axis=-1, keepdims=True)
  share_X = jnp.mean(jnp.sum(jax.nn.one_hot(idx_BxLxk, X, dtype=jnp.float32), axis=2), axis=(0, 1)) / top_k
  balance = X * jnp.sum(share_X * jnp.mean(probs_BxLxX, axis=(0, 1)))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxX, axis=-1)))
  return idx_BxLxk, w_BxLxk, balance, z


def capacity(tokens: int, experts: int, top_k: int, factor: float) -> int:
  if factor == 0:
    return tokens  # a token picks an expert at most once, so no expert can overflow
  return max(1, math.ceil(factor * tokens * top_k / experts))


def slots(idx_Txk, experts: int, cap: int):
  """Slot of each assignment in its expert's buffer, and whether it fits (slot < cap)."""
  T, k = idx_Txk.shape
  onehot_NxX = jax.nn.one_hot(idx_Txk.T.reshape(-1), experts, dtype=jnp.int32)  # choice-major order
  slot_N = jnp.sum((jnp.cumsum(onehot_NxX, axis=0) - 1) * onehot_NxX, axis=-1)
  slot_Txk = slot_N.reshape(k, T).T
  return slot_Txk, slot_Txk < cap


def dispatch(x_TxD, idx_Txk, slot_Txk, keep_Txk, experts: int, cap: int):
  """Tokens -> per-expert buffers (X, C, D); dropped assignments land in a discarded row."""
  T, k = idx_Txk.shape
  flat = jnp.where(keep_Txk, idx_Txk * cap + slot_Txk, experts * cap).reshape(-1)
  x_rep = jnp.broadcast_to(x_TxD[:, None], (T, k, x_TxD.shape[-1])).reshape(T * k, -1)
  buf = jnp.zeros((experts * cap + 1, x_TxD.shape[-1]), x_TxD.dtype).at[flat].add(x_rep)
  return buf[:-1].reshape(experts, cap, -1)


def combine(out_XxCxD, idx_Txk, slot_Txk, keep_Txk, w_Txk):
  """Per-expert outputs -> tokens: sum over the kept choices of weight * expert output."""
  X, C, D = out_XxCxD.shape
  flat = jnp.where(keep_Txk, idx_Txk * C + slot_Txk, 0)
  got_TxkxD = out_XxCxD.reshape(X * C, D)[flat].astype(jnp.float32)
  return jnp.einsum("tkd,tk->td", got_TxkxD, w_Txk * keep_Txk)


def experts_ffn(buf_XxNxD, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, plan):
  """SwiGLU of every expert on its own buffer (hidden Megatron-sharded over `tensor`)."""
  g = jnp.einsum("xnd,xdf->xnf", buf_XxNxD, w_gate_XxDxF)
  u = jnp.einsum("xnd,xdf->xnf", buf_XxNxD, w_up_XxDxF)
  h_XxNxF = plan.constrain(jax.nn.silu(g) * u, ("act_experts", None, "act_mlp"))
  return jnp.einsum("xnf,xfd->xnd", h_XxNxF, w_down_XxFxD)


def moe_ffn(x_BxLxD, router_DxX, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, *, top_k: int,
            capacity_factor: float, plan):
  """The MoE feed-forward, dispatched as the execution plan says. Returns (y_BxLxD, stats):
  stats holds the load-balance loss, the z-loss, and the dropped and total assignment
  counts (float32 scalars)."""
  B, L, D = x_BxLxD.shape
  X = router_DxX.shape[1]
  idx, w, balance, z = route(x_BxLxD, router_DxX, top_k)
  if plan.moe != "all_to_all":
    T = B * L
    cap = capacity(T, X, top_k, capacity_factor)
    idx_T, w_T = idx.reshape(T, top_k), w.reshape(T, top_k)
    slot, keep = slots(idx_T, X, cap)
    out = experts_ffn(dispatch(x_BxLxD.reshape(T, D), idx_T, slot, keep, X, cap), w_gate_XxDxF, w_up_XxDxF,
                      w_down_XxFxD, plan)
    y = combine(out, idx_T, slot, keep, w_T).reshape(B, L, D)
    dropped = jnp.sum(~keep).astype(jnp.float32)
  else:
    y, dropped = _expert_parallel(x_BxLxD, idx, w, (w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD), plan,
                                  top_k, capacity_factor)
  stats = {"balance": balance, "z": z, "dropped": jax.lax.stop_gradient(dropped),
           "assigned": jnp.float32(B * L * top_k)}
  return y.astype(x_BxLxD.dtype), stats


def _expert_parallel(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan, top_k, capacity_factor):
  X = weights[0].shape[0]
  mesh, AXIS = plan.mesh, plan.expert_axis
  ep = mesh.shape[AXIS]
  tok_spec = plan.spec(("batch", "length", None), x_BxLxD.shape)
  tok_axes = tuple(a for entry in tok_spec[:2] if entry for a in ((entry,) if isinstance(entry, str) else entry))
  other = tuple(a for a in tok_axes if a != AXIS)
  buf_spec = P(AXIS, other or None, None)  # (experts, tokens of every group, D)

  def send(x_bxnxD, idx_bxnxk):
    b, n, D = x_bxnxD.shape
    T = b * n
    cap = capacity(T, X, top_k, capacity_factor)
    idx = idx_bxnxk.reshape(T, top_k)
    slot, keep = slots(idx, X, cap)
    buf_XxCxD = dispatch(x_bxnxD.reshape(T, D), idx, slot, keep, X, cap)
    # Expert e's rows go to the device that owns e; we get every group's rows for ours.
    buf = jax.lax.all_to_all(buf_XxCxD.reshape(ep, X // ep, cap, D), AXIS, 0, 0)  # (source, Xl, C, D)
    buf = buf.swapaxes(0, 1).reshape(X // ep, ep * cap, D)
    dropped = jnp.sum(~keep).astype(jnp.float32)
    dropped = jax.lax.psum(dropped, tok_axes) if tok_axes else dropped
    return buf, slot.reshape(b, n, top_k), keep.reshape(b, n, top_k), dropped

  def receive(out_XlxNxD, idx_bxnxk, slot_bxnxk, keep_bxnxk, w_bxnxk):
    b, n, k = idx_bxnxk.shape
    Xl, N, D = out_XlxNxD.shape
    out = out_XlxNxD.reshape(Xl, ep, N // ep, D).swapaxes(0, 1)  # (source group, Xl, C, D)
    out = jax.lax.all_to_all(out, AXIS, 0, 0).reshape(X, N // ep, D)  # back home: (X, C, D)
    y = combine(out, idx_bxnxk.reshape(b * n, k), slot_bxnxk.reshape(b * n, k), keep_bxnxk.reshape(b * n, k),
                w_bxnxk.reshape(b * n, k))
    return y.reshape(b, n, D)

  # check_vma=False: tokens are replicated over axes such as `tensor`; every replica does
  # the same work, which shard_map's transpose accounts for without replication typing.
  buf, slot, keep, dropped = jax.shard_map(
      send, mesh=mesh, in_specs=(tok_spec, tok_spec), out_specs=(buf_spec, tok_spec, tok_spec, P()),
      check_vma=False)(x_BxLxD, idx_BxLxk)
  out = experts_ffn(buf, *(w.astype(buf.dtype) for w in weights), plan)
  y = jax.shard_map(receive, mesh=mesh, in_specs=(buf_spec, tok_spec, tok_spec, tok_spec, tok_spec),
                    out_specs=tok_spec, check_vma=False)(out, idx_BxLxk, slot, keep, w_BxLxk)
  return y, dropped
