"""Dropless experts over the `expert` axis: a static exact bound of rows per peer through two all_to_alls (no
ragged_all_to_all on XLA:CPU), each device's experts by the grouped matmuls of jaxtrain.model.moe_kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.model import moe_kernels
from jaxtrain.parallel import expert_layout as moe_layout, sharding


def _local(x_TxD, idx_Txk, w_Txk, weights, ep: int, impl: str, axis: str = "expert", project=None, act=None):
  """This device's tokens -> their MoE output (T, D) float32; ep > 1 inside a shard_map."""
  T, k = idx_Txk.shape
  X = weights[0].shape[0] * ep
  flat_N = idx_Txk.reshape(-1)  # assignment a = token a // k, choice a % k
  if ep == 1:
    y_NxD = moe_kernels.grouped_ffn(jnp.repeat(x_TxD, k, axis=0), flat_N, X, weights, impl=impl, project=project,
                                    act=act)
  else:
    Xl = X // ep
    bound = moe_layout.dropless_bound(T, X, k, ep)
    dest_N = flat_N // Xl
    order_N = jnp.argsort(flat_N, stable=True)  # by expert, hence by destination device
    count_ep = jnp.zeros((ep,), jnp.int32).at[dest_N].add(1)
    start_ep = jnp.cumsum(count_ep) - count_ep
    row_N = jnp.zeros_like(flat_N).at[order_N].set(jnp.arange(flat_N.size) - start_ep[dest_N[order_N]])
    slot_N = dest_N * bound + row_N  # assignment a's row in the (ep, bound) send buffer
    r = jnp.arange(bound)
    src_S = order_N[jnp.minimum(start_ep[:, None] + r, flat_N.size - 1)].reshape(-1)  # the assignment in each slot
    keep_S = (r < count_ep[:, None]).reshape(-1)
    send = moe_kernels.move(x_TxD, src_S // k, keep_S, slot_N.reshape(T, k), jnp.ones((T, k), bool))
    send = send.reshape(ep, bound, -1)
    ids = jnp.where(keep_S, flat_N[src_S] % Xl, Xl).reshape(ep, bound)
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # (source device, bound, D) for our experts
    recv_ids = jax.lax.all_to_all(ids, axis, 0, 0)
    out = moe_kernels.grouped_ffn(recv.reshape(ep * bound, -1), recv_ids.reshape(-1), Xl, weights, impl=impl,
                                  skip_empty=True, project=project, act=act)
    back = jax.lax.all_to_all(out.reshape(ep, bound, -1), axis, 0, 0)  # (destination device, bound, D)
    y_NxD = moe_kernels.move(back.reshape(ep * bound, -1), slot_N, jnp.ones(slot_N.shape, bool), src_S[:, None],
                 keep_S[:, None])
  return jnp.einsum("tkd,tk->td", y_NxD.reshape(T, k, -1).astype(jnp.float32), w_Txk)


def ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan, act=None):
  """Dropless MoE output (B, L, D) float32; weights (X,D,F),(X,D,F),(X,F,D)[, their biases (X,F),(X,F),(X,D)];
  kernel and mesh are the plan's."""
  impl, axis, mesh = plan.moe_kernel, plan.expert_axis, moe_layout.dispatch_mesh(plan)
  ep = 1 if mesh is None else mesh.shape[axis]

  def local(x_bxnxD, idx_bxnxk, w_bxnxk, *ws):
    b, n, D = x_bxnxD.shape
    k = idx_bxnxk.shape[-1]
    return _local(x_bxnxD.reshape(b * n, D), idx_bxnxk.reshape(b * n, k), w_bxnxk.reshape(b * n, k), ws, ep, impl,
                  axis, plan.expert_projection(), act).reshape(b, n, D)
  if mesh is None:
    return local(x_BxLxD, idx_BxLxk, w_BxLxk, *weights)
  tok_spec = moe_layout.token_spec(mesh, *x_BxLxD.shape[:2], plan.rules)
  w_specs = tuple(P(axis, *(None,) * (w.ndim - 1)) for w in weights)  # each expert's weights (and biases) on its device
  return sharding.manual(local, mesh, (tok_spec,) * 3 + w_specs, tok_spec)(x_BxLxD, idx_BxLxk, w_BxLxk, *weights)
