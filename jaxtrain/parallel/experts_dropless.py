"""Dropless experts: every token-to-expert assignment is computed, with grouped matmuls.

One device: the k assignments of every token are sorted by expert (stable), the three
expert matmuls are `jax.lax.ragged_dot` over the sorted rows with the per-expert counts
as group sizes, and the outputs go back to assignment order by the inverse permutation,
weighted and summed per token. No buffer is padded to "all tokens per expert".

Expert parallelism (a `shard_map` over the whole mesh): each device sorts its
assignments by expert, so by owning device, and writes them into a send buffer
(ep, bound, D): row r of block d is its r-th assignment to device d's experts. The bound
is static and exact: a token picks distinct experts, so it sends at most min(k, X/ep)
rows to one device, bound = tokens x min(k, X/ep). (`jax.lax.ragged_all_to_all` would send
only the filled rows, but XLA:CPU of jax 0.10 does not implement it: "HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter".) One `all_to_all` over
`expert` delivers every device's rows for our X/ep experts with their local expert ids
(padding rows carry id X/ep); they run through the grouped matmuls as above (padding
sorted last, outside every group, zeroed) and a second `all_to_all` brings them home.

The expert weights enter the `shard_map` whole except for the `experts` dim: XLA gathers
their FSDP/tensor shards before it (and reduce-scatters the gradients after), and every
tensor rank computes the same rows (tokens are replicated over `tensor`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel import expert_layout as moe_layout


def kernel(name: str, platform: str) -> str:
  """model.moe_grouped_matmul on the target device's platform -> the kernel that runs
  (the execution plan's decision): `auto` is ragged_dot where the backend has a
  grouped-matmul kernel for it (GPU, TPU), else blocks (XLA:CPU lowers ragged_dot to a
  dense product with every expert: X times the work)."""
  if name != "auto":
    return name
  return "ragged_dot" if platform in ("gpu", "cuda", "rocm", "tpu") else "blocks"


def grouped_ffn(rows_NxD, expert_N, experts: int, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, impl: str = "ragged_dot",
                skip_empty: bool = False):
  """SwiGLU of each row through expert expert_N[i] (ids >= experts: padding, output 0)."""
  if experts == 1:  # one local expert (X = ep): plain matmuls, padding rows masked; no sort
    h = jax.nn.silu(rows_NxD @ w_gate_XxDxF[0]) * (rows_NxD @ w_up_XxDxF[0])
    return jnp.where((expert_N == 0)[:, None], h @ w_down_XxFxD[0], 0)
  if impl == "blocks":
    return blocked_ffn(rows_NxD, expert_N, experts, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, skip_empty)
  order_N = jnp.argsort(expert_N, stable=True)
  inverse_N = jnp.argsort(order_N)
  sizes_X = jnp.zeros((experts + 1,), jnp.int32).at[jnp.minimum(expert_N, experts)].add(1)[:experts]
  x_NxD = rows_NxD[order_N]
  g_NxF = jax.lax.ragged_dot(x_NxD, w_gate_XxDxF, sizes_X)
  u_NxF = jax.lax.ragged_dot(x_NxD, w_up_XxDxF, sizes_X)
  y_NxD = jax.lax.ragged_dot(jax.nn.silu(g_NxF) * u_NxF, w_down_XxFxD, sizes_X)
  valid_N = jnp.arange(rows_NxD.shape[0]) < jnp.sum(sizes_X)  # rows past every group: padding
  return jnp.where(valid_N[:, None], y_NxD, 0)[inverse_N]


def block_rows(rows: int, experts: int) -> int:
  """Rows per block of `blocked_ffn`: a power of two near rows / (4 experts), at least 8, so
  the padding (under one block per expert) stays near a quarter of the rows."""
  return max(8, 1 << max(0, (rows // (4 * experts)).bit_length() - 1))


def blocked_ffn(rows_NxD, expert_N, experts: int, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, skip_empty: bool = False):
  """`grouped_ffn` as matmuls over blocks of rows of one expert each: rows sorted by
  expert, each expert's run padded to a multiple of the block (static bound N + X(b-1)
  rows), each block multiplied by its expert's weights: one batched matmul with the
  weights gathered per block, or (skip_empty, for the expert-parallel exchange whose
  static bound is mostly padding) a loop over the blocks that skips those past the rows
  in use."""
  N, D = rows_NxD.shape
  b = block_rows(N, experts)
  nb = -(-(N + experts * (b - 1)) // b)
  order_N = jnp.argsort(expert_N, stable=True)
  e_N = expert_N[order_N]  # sorted; padding ids (>= experts) last
  sizes = jnp.zeros((experts + 1,), jnp.int32).at[jnp.minimum(e_N, experts)].add(1)
  start = jnp.cumsum(sizes) - sizes
  padded_X = -(-sizes[:experts] // b) * b
  pend_X = jnp.cumsum(padded_X)
  e_c = jnp.minimum(e_N, experts - 1)
  dest_N = jnp.where(e_N < experts, pend_X[e_c] - padded_X[e_c] + jnp.arange(N) - start[e_c], nb * b)
  x_blocks = jnp.zeros((nb * b + 1, D), rows_NxD.dtype).at[dest_N].set(rows_NxD[order_N])[:-1].reshape(nb, b, D)
  block_e = jnp.minimum(jnp.searchsorted(pend_X, jnp.arange(nb) * b, side="right"), experts - 1)
  if not skip_empty:  # every block in one batched matmul, weights gathered per block
    g = jnp.einsum("nbd,ndf->nbf", x_blocks, w_gate_XxDxF[block_e])
    u = jnp.einsum("nbd,ndf->nbf", x_blocks, w_up_XxDxF[block_e])
    y = jnp.einsum("nbf,nfd->nbd", jax.nn.silu(g) * u, w_down_XxFxD[block_e]).reshape(nb * b, D)
    return jnp.concatenate([y, jnp.zeros((1, D), y.dtype)])[dest_N][jnp.argsort(order_N)]
  used = pend_X[-1]  # rows in use; the exchange's static bound covers the worst case, most blocks are empty

  def one(args):  # a loop over blocks: empty ones are skipped (in the backward pass too)
    x_bxD, e, first = args

    def swiglu(_):
      h = jax.nn.silu(x_bxD @ w_gate_XxDxF[e]) * (x_bxD @ w_up_XxDxF[e])
      return h @ w_down_XxFxD[e]
    return jax.lax.cond(first < used, swiglu, lambda _: jnp.zeros_like(x_bxD), None)
  y = jax.lax.map(one, (x_blocks, block_e, jnp.arange(nb) * b)).reshape(nb * b, D)
  y_sorted = jnp.concatenate([y, jnp.zeros((1, D), y.dtype)])[dest_N]  # padding rows -> the zero row
  return y_sorted[jnp.argsort(order_N)]


def _local(x_TxD, idx_Txk, w_Txk, weights, ep: int, impl: str, axis: str = "expert"):
  """This device's tokens -> their MoE output (T, D) float32; ep > 1 inside a shard_map."""
  T, k = idx_Txk.shape
  X = weights[0].shape[0] * ep
  flat_N = idx_Txk.reshape(-1)  # assignment a = token a // k, choice a % k
  rows_NxD = jnp.repeat(x_TxD, k, axis=0)
  if ep == 1:
    y_NxD = grouped_ffn(rows_NxD, flat_N, X, *weights, impl=impl)
  else:
    Xl = X // ep
    bound = moe_layout.dropless_bound(T, X, k, ep)
    dest_N = flat_N // Xl
    order_N = jnp.argsort(flat_N, stable=True)  # by expert, hence by destination device
    count_ep = jnp.zeros((ep,), jnp.int32).at[dest_N].add(1)
    start_ep = jnp.cumsum(count_ep) - count_ep
    row_N = jnp.zeros_like(flat_N).at[order_N].set(jnp.arange(flat_N.size) - start_ep[dest_N[order_N]])
    send = jnp.zeros((ep, bound, x_TxD.shape[-1]), x_TxD.dtype).at[dest_N, row_N].set(rows_NxD)
    ids = jnp.full((ep, bound), Xl, jnp.int32).at[dest_N, row_N].set(flat_N % Xl)
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # (source device, bound, D) for our experts
    recv_ids = jax.lax.all_to_all(ids, axis, 0, 0)
    out = grouped_ffn(recv.reshape(ep * bound, -1), recv_ids.reshape(-1), Xl, *weights, impl=impl, skip_empty=True)
    back = jax.lax.all_to_all(out.reshape(ep, bound, -1), axis, 0, 0)  # (destination device, bound, D)
    y_NxD = back[dest_N, row_N]
  return jnp.einsum("tkd,tk->td", y_NxD.reshape(T, k, -1).astype(jnp.float32), w_Txk)


def ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan):
  """Dropless MoE output (B, L, D) float32 for routed tokens; weights (X,D,F),(X,D,F),(X,F,D);
  the kernel (`plan.moe_kernel`: ragged_dot or blocks) and the mesh are the plan's."""
  impl, axis = plan.moe_kernel, plan.expert_axis
  B, L, D = x_BxLxD.shape
  k = idx_BxLxk.shape[-1]
  weights = tuple(w.astype(x_BxLxD.dtype) for w in weights)
  mesh = plan.mesh if plan.moe == "all_to_all" else None
  if mesh is None:
    return _local(x_BxLxD.reshape(B * L, D), idx_BxLxk.reshape(B * L, k), w_BxLxk.reshape(B * L, k), weights,
                  1, impl, axis).reshape(B, L, D)
  ep = mesh.shape[axis]
  tok_spec = moe_layout.token_spec(mesh, B, L, plan.rules)

  def local(x_bxnxD, idx_bxnxk, w_bxnxk, *ws):
    b, n, _ = x_bxnxD.shape
    y = _local(x_bxnxD.reshape(b * n, D), idx_bxnxk.reshape(b * n, k), w_bxnxk.reshape(b * n, k), ws, ep, impl,
               axis)
    return y.reshape(b, n, D)

  w_spec = P(axis, None, None)
  # check_vma=False: tokens are replicated over axes such as `tensor`; every replica does
  # the same work, which shard_map's transpose accounts for without replication typing.
  return jax.shard_map(local, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, w_spec, w_spec, w_spec),
                       out_specs=tok_spec, check_vma=False)(x_BxLxD, idx_BxLxk, w_BxLxk, *weights)
