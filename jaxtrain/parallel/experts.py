"""MoE routing (float32 router, top-k, balance and z-loss stats), per-group capacity and the expert-parallel
dispatch/combine (all_to_all over `expert`); dropless runs in experts_dropless, as `plan.moe_kernel` says."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import fp8
from jaxtrain.parallel import experts_dropless as moe_dropless, expert_layout as moe_layout, sharding

capacity = moe_layout.capacity  # analysis.memory reads it here


def route(x_BxLxD, router_DxX, top_k: int, score: str = "softmax", bias_X=None, norm_top_k: bool = True,
          groups=(1, 1), scale: float = 1.0):
  """-> ids (B,L,k) int32, weights (B,L,k) f32 (summing to `scale` if norm_top_k, else the raw scores times
  `scale`), stats: balance, z, share f_e, prob P_e, load (X,). `groups` (n, best): choose among the `best` of n
  expert groups (ranked by their top-2 scores), DeepSeek-V3."""
  B, L, _ = x_BxLxD.shape
  X = router_DxX.shape[1]
  logits_BxLxX = jnp.einsum("bld,dx->blx", x_BxLxD.astype(jnp.float32), router_DxX.astype(jnp.float32))
  if score == "softmax":
    scores_BxLxX = probs_BxLxX = jax.nn.softmax(logits_BxLxX, axis=-1)
  else:  # sigmoid: independent per expert; P_e of the balance loss uses them normalized per token
    scores_BxLxX = jax.nn.sigmoid(logits_BxLxX)
    probs_BxLxX = scores_BxLxX / jnp.sum(scores_BxLxX, axis=-1, keepdims=True)
  pick = scores_BxLxX if bias_X is None else scores_BxLxX + jax.lax.stop_gradient(bias_X.astype(jnp.float32))
  if groups[0] > 1:
    pick = _group_limited(pick, *groups)
  _, idx_BxLxk = jax.lax.top_k(pick, top_k)
  w_BxLxk = jnp.take_along_axis(scores_BxLxX, idx_BxLxk, axis=-1)
  if norm_top_k:
    w_BxLxk = w_BxLxk / jnp.sum(w_BxLxk, axis=-1, keepdims=True)
  w_BxLxk = w_BxLxk * scale
  load_X = jnp.sum(jax.nn.one_hot(idx_BxLxk, X, dtype=jnp.float32), axis=(0, 1, 2))
  share_X = load_X / (B * L * top_k)
  prob_X = jnp.mean(probs_BxLxX, axis=(0, 1))
  stats = {"balance": X * jnp.sum(share_X * prob_X),
           "z": jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxX, axis=-1))),
           "share": share_X, "prob": prob_X, "load": jax.lax.stop_gradient(load_X)}
  return idx_BxLxk, w_BxLxk, stats


def _group_limited(pick_BxLxX, n: int, best: int):
  """Scores outside a token's `best` groups (by the sum of each group's top-2 scores) set to -inf."""
  B, L, X = pick_BxLxX.shape
  g_BxLxnxm = pick_BxLxX.reshape(B, L, n, X // n)
  group_BxLxn = jnp.sum(jax.lax.top_k(g_BxLxnxm, min(2, X // n))[0], axis=-1)
  _, keep_BxLxb = jax.lax.top_k(group_BxLxn, best)
  keep_BxLxn = jnp.sum(jax.nn.one_hot(keep_BxLxb, n, dtype=jnp.int32), axis=-2) > 0
  return jnp.where(keep_BxLxn[..., None], g_BxLxnxm, -jnp.inf).reshape(B, L, X)


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


def experts_ffn(buf_XxNxD, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, plan, slot_axes=None):
  """SwiGLU of every expert on its buffer; the hidden keeps the slots' split (`slot_axes`)."""
  g = fp8.einsum(plan.fp8, "xnd,xdf->xnf", buf_XxNxD, w_gate_XxDxF)
  u = fp8.einsum(plan.fp8, "xnd,xdf->xnf", buf_XxNxD, w_up_XxDxF)
  h_XxNxF = jax.nn.silu(g) * u
  axes = ("act_experts", None, "act_mlp")
  if slot_axes is None or plan.mesh is None:
    h_XxNxF = plan.constrain(h_XxNxF, axes)
  else:
    spec = plan.spec(axes, h_XxNxF.shape)
    h_XxNxF = jax.lax.with_sharding_constraint(h_XxNxF, NamedSharding(plan.mesh, P(spec[0], slot_axes, spec[2])))
  return fp8.einsum(plan.fp8, "xnf,xfd->xnd", h_XxNxF, w_down_XxFxD)


def moe_ffn(x_BxLxD, router_DxX, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, *, top_k: int,
            capacity_factor: float, plan, group_size: int = 0, score: str = "softmax", bias_X=None, **route_kw):
  """The MoE feed-forward as the plan says: (y_BxLxD, `route`'s stats + dropped and assigned counts)."""
  B, L, D = x_BxLxD.shape
  idx, w, stats = route(x_BxLxD, router_DxX, top_k, score, bias_X, **route_kw)
  weights = tuple(a.astype(x_BxLxD.dtype) for a in (w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD))
  if plan.moe_kernel != "capacity":
    y, dropped = moe_dropless.ffn(x_BxLxD, idx, w, weights, plan), jnp.float32(0)
  else:
    # Groups that do not fit B x L (moe_layout.check stops training first; Transformer.decode keeps groups
    # within rows): each row's positions are then one group, as by default.
    G = group_size if group_size and moe_layout.group_fits(group_size, L, B, L) else L
    y, dropped = _capacity_ffn(x_BxLxD, idx, w, weights, plan, top_k, capacity_factor, G)
  stats.update(dropped=jax.lax.stop_gradient(dropped), assigned=jnp.float32(B * L * top_k))
  return y.astype(x_BxLxD.dtype), stats


def _capacity_ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan, top_k, capacity_factor, G):
  X, AXIS, mesh = weights[0].shape[0], plan.expert_axis, moe_layout.dispatch_mesh(plan)
  ep = 1 if mesh is None else mesh.shape[AXIS]
  B, L, D = x_BxLxD.shape
  C = moe_layout.capacity(G, X, top_k, capacity_factor)
  tok_spec = None if mesh is None else moe_layout.token_spec(mesh, B, L, plan.rules)
  tok_axes = () if mesh is None else sharding.axes_of(tok_spec[0]) + sharding.axes_of(tok_spec[1])

  def send(x_bxnxD, idx_bxnxk):
    b, n, D = x_bxnxD.shape
    if not moe_layout.group_fits(G, L, b, n):
      raise ValueError(f"capacity group of {G} tokens does not fit the {b} x {n} tokens a device holds")
    ng = b * n // G  # groups on this device
    idx_gxGxk = idx_bxnxk.reshape(ng, G, top_k)
    slot, keep = jax.vmap(lambda i: slots(i, X, C))(idx_gxGxk)
    buf_gxXxCxD = jax.vmap(lambda x, i, s, k: dispatch(x, i, s, k, X, C))(x_bxnxD.reshape(ng, G, D), idx_gxGxk,
                                                                         slot, keep)
    buf = buf_gxXxCxD.swapaxes(0, 1).reshape(X, ng * C, D)  # (experts, this device's slots, D)
    if ep > 1:  # expert e's rows go to the device that owns e; we get every device's rows for ours
      buf = jax.lax.all_to_all(buf.reshape(ep, X // ep, ng * C, D), AXIS, 0, 0)  # (source, Xl, M, D)
      buf = buf.swapaxes(0, 1).reshape(X // ep, ep * ng * C, D)
    dropped = jnp.sum(~keep).astype(jnp.float32)
    return buf, slot, keep, jax.lax.psum(dropped, tok_axes) if tok_axes else dropped

  def receive(out_XlxNxD, idx_bxnxk, slot_gxGxk, keep_gxGxk, w_bxnxk):
    b, n, k = idx_bxnxk.shape
    Xl, N, D = out_XlxNxD.shape
    ng = slot_gxGxk.shape[0]
    out_XxMxD = out_XlxNxD
    if ep > 1:  # back home: (source device, Xl, M, D) -> (X, M, D)
      out_XxMxD = jax.lax.all_to_all(out_XlxNxD.reshape(Xl, ep, N // ep, D).swapaxes(0, 1), AXIS, 0, 0)
      out_XxMxD = out_XxMxD.reshape(X, N // ep, D)
    out_gxXxCxD = out_XxMxD.reshape(X, ng, C, D).swapaxes(0, 1)
    y = jax.vmap(combine)(out_gxXxCxD, idx_bxnxk.reshape(ng, G, k), slot_gxGxk, keep_gxGxk,
                          w_bxnxk.reshape(ng, G, k))
    return y.reshape(b, n, D)

  if mesh is None:
    buf, slot, keep, dropped = send(x_BxLxD, idx_BxLxk)
    return receive(experts_ffn(buf, *weights, plan), idx_BxLxk, slot, keep, w_BxLxk), dropped
  other = tuple(a for a in tok_axes if a != AXIS)
  buf_spec = P(AXIS, other or None, None)  # (experts, slots of every device's groups, D)
  grp_spec = P(tok_axes or None, None, None)  # (groups, G, k): groups follow their tokens
  buf, slot, keep, dropped = sharding.manual(send, mesh, (tok_spec, tok_spec), (buf_spec, grp_spec, grp_spec, P()))(
      x_BxLxD, idx_BxLxk)
  out = experts_ffn(buf, *weights, plan, other or None)
  y = sharding.manual(receive, mesh, (buf_spec, tok_spec, grp_spec, grp_spec, tok_spec), tok_spec)(
      out, idx_BxLxk, slot, keep, w_BxLxk)
  return y, dropped
