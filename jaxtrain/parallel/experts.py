"""The routed experts as the plan runs them: capacity groups dispatched over `expert` by all_to_all (or on one device),
dropless experts through jaxtrain.parallel.experts_dropless. The math of each device's part is
jaxtrain.model.moe_kernels; the routing is the model's (jaxtrain.model.moe)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain.model import moe, moe_kernels
from jaxtrain.parallel import experts_dropless, expert_layout as moe_layout, sharding


def ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, group: int, cap: int | None, plan, act=None):
  """(y (B, L, D) float32, dropped assignments): the plan's Ops.experts (`weights` with or without the experts'
  biases, moe_kernels.biases; `act`: activation.glu's)."""
  if cap is None:
    return experts_dropless.ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan, act), jax.numpy.float32(0)
  return _capacity_ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan, group, cap, act)


def _hidden(plan, slot_axes):
  """The experts' (X, N, F) hidden annotation: experts over `expert`, F over `tensor`, the slots' split kept."""
  axes = ("act_experts", None, "act_mlp")

  def annotate(h_XxNxF):
    if slot_axes is None or plan.mesh is None:
      return plan.constrain(h_XxNxF, axes)
    spec = plan.spec(axes, h_XxNxF.shape)
    return jax.lax.with_sharding_constraint(h_XxNxF, NamedSharding(plan.mesh, P(spec[0], slot_axes, spec[2])))
  return annotate


def _capacity_ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan, G: int, C: int, act=None):
  X, AXIS, mesh = weights[0].shape[0], plan.expert_axis, moe_layout.dispatch_mesh(plan)
  ep = 1 if mesh is None else mesh.shape[AXIS]
  B, L, D = x_BxLxD.shape
  tok_spec = None if mesh is None else moe_layout.token_spec(mesh, B, L, plan.rules)
  tok_axes = () if mesh is None else sharding.axes_of(tok_spec[0]) + sharding.axes_of(tok_spec[1])

  def send(x_bxnxD, idx_bxnxk):
    b, n, D = x_bxnxD.shape
    if not moe.group_fits(G, L, b, n):
      raise ValueError(f"capacity group of {G} tokens does not fit the {b} x {n} tokens a device holds")
    buf, slot, keep, dropped = moe_kernels.group_dispatch(x_bxnxD, idx_bxnxk, X, C, G)
    if ep > 1:  # expert e's rows go to the device that owns e; we get every device's rows for ours
      M = buf.shape[1]
      buf = jax.lax.all_to_all(buf.reshape(ep, X // ep, M, D), AXIS, 0, 0)  # (source, Xl, M, D)
      buf = buf.swapaxes(0, 1).reshape(X // ep, ep * M, D)
    return buf, slot, keep, jax.lax.psum(dropped, tok_axes) if tok_axes else dropped

  def receive(out_XlxNxD, idx_bxnxk, slot_gxGxk, keep_gxGxk, w_bxnxk):
    Xl, N, D = out_XlxNxD.shape
    out_XxMxD = out_XlxNxD
    if ep > 1:  # back home: (source device, Xl, M, D) -> (X, M, D)
      out_XxMxD = jax.lax.all_to_all(out_XlxNxD.reshape(Xl, ep, N // ep, D).swapaxes(0, 1), AXIS, 0, 0)
      out_XxMxD = out_XxMxD.reshape(X, N // ep, D)
    return moe_kernels.group_combine(out_XxMxD, idx_bxnxk, slot_gxGxk, keep_gxGxk, w_bxnxk)

  if mesh is None:
    buf, slot, keep, dropped = send(x_BxLxD, idx_BxLxk)
    out = moe_kernels.swiglu(buf, weights, plan.expert_einsum, _hidden(plan, None), act)
    return receive(out, idx_BxLxk, slot, keep, w_BxLxk), dropped
  other = tuple(a for a in tok_axes if a != AXIS)
  buf_spec = P(AXIS, other or None, None)  # (experts, slots of every device's groups, D)
  grp_spec = P(tok_axes or None, None, None)  # (groups, G, k): groups follow their tokens
  buf, slot, keep, dropped = sharding.manual(send, mesh, (tok_spec, tok_spec), (buf_spec, grp_spec, grp_spec, P()))(
      x_BxLxD, idx_BxLxk)
  out = moe_kernels.swiglu(buf, weights, plan.expert_einsum, _hidden(plan, other or None), act)
  y = sharding.manual(receive, mesh, (buf_spec, tok_spec, grp_spec, grp_spec, tok_spec), tok_spec)(
      out, idx_BxLxk, slot, keep, w_BxLxk)
  return y, dropped
