"""Mixture-of-experts routing, capacity, and expert-parallel dispatch/combine.

Routing (plain math, XLA-sharded like any activation): float32 router logits, scores
(softmax over experts, or a sigmoid per expert), top-k experts per token chosen on the
scores plus an optional balancing bias (selection only), their score weights
renormalized to sum to 1. Two auxiliary losses, both over all tokens of the microbatch
(so they do not depend on the mesh), combined per `moe_balance.aux_loss`:
  load balance  X * sum_e f_e * P_e   (f_e: share of the T*k assignments that chose e,
                                       P_e: mean router probability of e; 1 when uniform)
  router z-loss mean_t logsumexp(logits_t)^2

Capacity (`moe_layout`): tokens are routed in groups of G consecutive positions, defined
by the data, so every mesh drops the same tokens. Each expert takes at most
C = ceil(capacity_factor * G * k / X) assignments of a group; first choices are served
before second choices, earlier tokens before later ones. Assignments past C are dropped
(they add nothing; the residual stream carries the token) and counted.

Expert parallelism: with a mesh, dispatch and combine are `shard_map`s over the whole
mesh with an `all_to_all` over `expert`: each device scatters its groups' tokens into
per-expert buffers (X, groups x C, D), sends expert e's rows to the device that owns e,
and gets back the outputs for its tokens. Between the two, the expert FFN is an ordinary
einsum on (X, tokens, D) buffers sharded over `expert` (so each device computes its own
experts), with FSDP/tensor sharding of the expert weights left to XLA.

Dropless (`moe_dropless`): `jaxtrain.parallel.experts_dropless`, grouped matmuls with no capacity.
Which of these runs, and on which mesh, is the execution plan's decision (`plan.moe`,
`plan.moe_kernel`); nothing here looks the mesh up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.parallel import experts_dropless as moe_dropless
from jaxtrain.parallel import expert_layout as moe_layout


def route(x_BxLxD, router_DxX, top_k: int, score: str = "softmax", bias_X=None):
  """-> expert ids (B,L,k) int32, weights (B,L,k) f32 summing to 1, and stats: `balance`,
  `z`, `share` (X,) f_e, `prob` (X,) P_e, `load` (X,) assignments per expert (float32)."""
  B, L, _ = x_BxLxD.shape
  X = router_DxX.shape[1]
  logits_BxLxX = jnp.einsum("bld,dx->blx", x_BxLxD.astype(jnp.float32), router_DxX.astype(jnp.float32))
  if score == "softmax":
    scores_BxLxX = probs_BxLxX = jax.nn.softmax(logits_BxLxX, axis=-1)
  else:  # sigmoid: independent per expert; P_e of the balance loss uses them normalized per token
    scores_BxLxX = jax.nn.sigmoid(logits_BxLxX)
    probs_BxLxX = scores_BxLxX / jnp.sum(scores_BxLxX, axis=-1, keepdims=True)
  pick = scores_BxLxX if bias_X is None else scores_BxLxX + jax.lax.stop_gradient(bias_X.astype(jnp.float32))
  _, idx_BxLxk = jax.lax.top_k(pick, top_k)
  w_BxLxk = jnp.take_along_axis(scores_BxLxX, idx_BxLxk, axis=-1)
  w_BxLxk = w_BxLxk / jnp.sum(w_BxLxk, axis=-1, keepdims=True)
  load_X = jnp.sum(jax.nn.one_hot(idx_BxLxk, X, dtype=jnp.float32), axis=(0, 1, 2))
  share_X = load_X / (B * L * top_k)
  prob_X = jnp.mean(probs_BxLxX, axis=(0, 1))
  stats = {"balance": X * jnp.sum(share_X * prob_X),
           "z": jnp.mean(jnp.square(jax.nn.logsumexp(logits_BxLxX, axis=-1))),
           "share": share_X, "prob": prob_X, "load": jax.lax.stop_gradient(load_X)}
  return idx_BxLxk, w_BxLxk, stats


capacity = moe_layout.capacity


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
  """SwiGLU of every expert on its own buffer (hidden Megatron-sharded over `tensor`).
  `slot_axes`: the mesh axes that split the buffer's slots (N). The hidden keeps that split:
  left unsaid, XLA may all-gather the hidden activations over those axes (fsdp) instead of
  gathering the expert weights (seen on mixtral-8x7b at fsdp=8 x expert=8: 4.4 GiB per layer)."""
  g = jnp.einsum("xnd,xdf->xnf", buf_XxNxD, w_gate_XxDxF)
  u = jnp.einsum("xnd,xdf->xnf", buf_XxNxD, w_up_XxDxF)
  h_XxNxF = jax.nn.silu(g) * u
  axes = ("act_experts", None, "act_mlp")
  if slot_axes is None or plan.mesh is None:
    h_XxNxF = plan.constrain(h_XxNxF, axes)
  else:
    spec = plan.spec(axes, h_XxNxF.shape)
    h_XxNxF = jax.lax.with_sharding_constraint(h_XxNxF, NamedSharding(plan.mesh, P(spec[0], slot_axes, spec[2])))
  return jnp.einsum("xnf,xfd->xnd", h_XxNxF, w_down_XxFxD)


def moe_ffn(x_BxLxD, router_DxX, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, *, top_k: int,
            capacity_factor: float, plan, group_size: int = 0, score: str = "softmax", bias_X=None):
  """The MoE feed-forward, dispatched as the execution plan says (`plan.moe`: one local
  group set or all_to_all over `expert`; `plan.moe_kernel`: capacity buffers, or dropless
  grouped matmuls by ragged_dot or blocks). Returns (y_BxLxD, stats): `route`'s stats
  plus the dropped and total assignment counts (float32 scalars). group_size 0 = one
  sequence."""
  B, L, D = x_BxLxD.shape
  idx, w, stats = route(x_BxLxD, router_DxX, top_k, score, bias_X)
  weights = (w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD)
  mesh = plan.mesh if plan.moe == "all_to_all" else None
  if plan.moe_kernel != "capacity":
    y, dropped = moe_dropless.ffn(x_BxLxD, idx, w, weights, plan), jnp.float32(0)
  else:
    G = group_size or L
    if (B * L) % G:
      # Only generation gets here (moe_layout.check stops training and eval first): it feeds
      # a few positions at a time, and each row's fed positions are one group, as they are
      # with the default group size.
      G = L
    y, dropped = _capacity_ffn(x_BxLxD, idx, w, weights, mesh, plan, top_k, capacity_factor, G)
  stats.update(dropped=jax.lax.stop_gradient(dropped), assigned=jnp.float32(B * L * top_k))
  return y.astype(x_BxLxD.dtype), stats


def _capacity_ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, mesh, plan, top_k, capacity_factor, G):
  X = weights[0].shape[0]
  AXIS = plan.expert_axis
  ep = 1 if mesh is None else mesh.shape[AXIS]
  B, L, D = x_BxLxD.shape
  C = capacity(G, X, top_k, capacity_factor)

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
    if ep > 1:
      # Expert e's rows go to the device that owns e; we get every device's rows for ours.
      buf = jax.lax.all_to_all(buf.reshape(ep, X // ep, ng * C, D), AXIS, 0, 0)  # (source, Xl, M, D)
      buf = buf.swapaxes(0, 1).reshape(X // ep, ep * ng * C, D)
    dropped = jnp.sum(~keep).astype(jnp.float32)
    if tok_axes:
      dropped = jax.lax.psum(dropped, tok_axes)
    return buf, slot, keep, dropped

  def receive(out_XlxNxD, idx_bxnxk, slot_gxGxk, keep_gxGxk, w_bxnxk):
    b, n, k = idx_bxnxk.shape
    Xl, N, D = out_XlxNxD.shape
    ng = slot_gxGxk.shape[0]
    if ep > 1:
      out = out_XlxNxD.reshape(Xl, ep, N // ep, D).swapaxes(0, 1)  # (source device, Xl, M, D)
      out_XxMxD = jax.lax.all_to_all(out, AXIS, 0, 0).reshape(X, N // ep, D)  # back home
    else:
      out_XxMxD = out_XlxNxD
    out_gxXxCxD = out_XxMxD.reshape(X, ng, C, D).swapaxes(0, 1)
    y = jax.vmap(combine)(out_gxXxCxD, idx_bxnxk.reshape(ng, G, k), slot_gxGxk, keep_gxGxk,
                          w_bxnxk.reshape(ng, G, k))
    return y.reshape(b, n, D)

  ffn_weights = lambda dt: (w.astype(dt) for w in weights)  # noqa: E731
  if mesh is None:
    tok_axes = ()
    buf, slot, keep, dropped = send(x_BxLxD, idx_BxLxk)
    return receive(experts_ffn(buf, *ffn_weights(buf.dtype), plan), idx_BxLxk, slot, keep, w_BxLxk), dropped

  tok_spec = moe_layout.token_spec(mesh, B, L, plan.rules)
  tok_axes = tuple(a for entry in tok_spec[:2] if entry for a in ((entry,) if isinstance(entry, str) else entry))
  other = tuple(a for a in tok_axes if a != AXIS)
  buf_spec = P(AXIS, other or None, None)  # (experts, slots of every device's groups, D)
  grp_spec = P(tok_axes or None, None, None)  # (groups, G, k): groups follow their tokens
  # check_vma=False: tokens are replicated over axes such as `tensor`; every replica does
  # the same work, which shard_map's transpose accounts for without replication typing.
  buf, slot, keep, dropped = jax.shard_map(
      send, mesh=mesh, in_specs=(tok_spec, tok_spec), out_specs=(buf_spec, grp_spec, grp_spec, P()),
      check_vma=False)(x_BxLxD, idx_BxLxk)
  out = experts_ffn(buf, *ffn_weights(buf.dtype), plan, other or None)
  y = jax.shard_map(receive, mesh=mesh, in_specs=(buf_spec, tok_spec, grp_spec, grp_spec, tok_spec),
                    out_specs=tok_spec, check_vma=False)(out, idx_BxLxk, slot, keep, w_BxLxk)
  return y, dropped
