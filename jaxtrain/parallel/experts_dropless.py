"""Dropless experts: grouped matmuls (ragged_dot, or blocks of one expert each), and the expert-parallel
exchange: a static exact bound of rows per peer through two all_to_alls (no ragged_all_to_all on XLA:CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.model import fp8
from jaxtrain.parallel import expert_layout as moe_layout, sharding


def kernel(name: str, platform: str) -> str:
  """model.moe_grouped_matmul -> the kernel: `auto` is ragged_dot on TPU, else blocks. XLA:GPU (as XLA:CPU) rewrites
  ragged_dot into dense dots over every group: (rows, experts, d_model) buffers, 112 GiB per DeepSeek-V3 layer."""
  if name == "auto":
    return "ragged_dot" if platform == "tpu" else "blocks"
  return name


def grouped_ffn(rows_NxD, expert_N, experts: int, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, impl: str = "ragged_dot",
                skip_empty: bool = False, fp8_mode: str = "none"):
  """SwiGLU of each row through expert expert_N[i] (ids >= experts: padding, output 0); model.fp8 = fp8_mode."""
  mm = lambda fn, x, w, *a: fp8.matmul(fp8_mode, fn, x, w, *a)  # noqa: E731
  if experts == 1:  # one local expert (X = ep): plain matmuls, padding rows masked; no sort
    h = jax.nn.silu(mm(jnp.matmul, rows_NxD, w_gate_XxDxF[0])) * mm(jnp.matmul, rows_NxD, w_up_XxDxF[0])
    return jnp.where((expert_N == 0)[:, None], mm(jnp.matmul, h, w_down_XxFxD[0]), 0)
  if impl == "blocks":
    return blocked_ffn(rows_NxD, expert_N, experts, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, skip_empty, fp8_mode)
  order_N = jnp.argsort(expert_N, stable=True)
  inverse_N = jnp.argsort(order_N)
  sizes_X = jnp.zeros((experts + 1,), jnp.int32).at[jnp.minimum(expert_N, experts)].add(1)[:experts]
  x_NxD = rows_NxD[order_N]
  g_NxF = mm(jax.lax.ragged_dot, x_NxD, w_gate_XxDxF, sizes_X)
  u_NxF = mm(jax.lax.ragged_dot, x_NxD, w_up_XxDxF, sizes_X)
  y_NxD = mm(jax.lax.ragged_dot, jax.nn.silu(g_NxF) * u_NxF, w_down_XxFxD, sizes_X)
  valid_N = jnp.arange(rows_NxD.shape[0]) < jnp.sum(sizes_X)  # rows past every group: padding
  return jnp.where(valid_N[:, None], y_NxD, 0)[inverse_N]


@jax.custom_vjp
def move(x_MxD, take_S, keep_S, inv_MxJ, inv_keep_MxJ):
  """out[s] = x[take[s]] where keep[s], else 0: rows moved to their slots by a gather whose transpose is a gather
  too, ct_x[m] = the sum of ct_out[inv[m, j]] where inv_keep[m, j] (the J slots row m went to). A scatter would
  be simpler, but XLA:GPU scatters bfloat16 rows as 32-bit words: twice each buffer, in both passes."""
  return jnp.where(keep_S[:, None], x_MxD[take_S], 0)


def _move_fwd(x_MxD, take_S, keep_S, inv_MxJ, inv_keep_MxJ):
  return move(x_MxD, take_S, keep_S, inv_MxJ, inv_keep_MxJ), (inv_MxJ, inv_keep_MxJ)


def _move_bwd(res, ct_SxD):
  inv_MxJ, inv_keep_MxJ = res
  return jnp.sum(jnp.where(inv_keep_MxJ[..., None], ct_SxD[inv_MxJ], 0), axis=1), None, None, None, None


move.defvjp(_move_fwd, _move_bwd)


def blocked_ffn(rows_NxD, expert_N, experts: int, w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD, skip_empty: bool = False,
                fp8_mode: str = "none"):
  """`grouped_ffn` over blocks of b rows of one expert each: one batched matmul, or (skip_empty) a loop that
  skips the blocks past the rows in use (not with FP8: a scale's pmax cannot sit in a branch some devices skip)."""
  N, D = rows_NxD.shape
  b = max(8, 1 << max(0, (N // (4 * experts)).bit_length() - 1))  # power of two near N / 4X: padding ~N/4
  nb = -(-(N + experts * (b - 1)) // b)
  order_N = jnp.argsort(expert_N, stable=True)
  e_N = expert_N[order_N]  # sorted; padding ids (>= experts) last
  sizes = jnp.zeros((experts + 1,), jnp.int32).at[jnp.minimum(e_N, experts)].add(1)
  start = jnp.cumsum(sizes) - sizes
  padded_X = -(-sizes[:experts] // b) * b
  pend_X = jnp.cumsum(padded_X)
  e_c = jnp.minimum(e_N, experts - 1)
  dest_N = jnp.where(e_N < experts, pend_X[e_c] - padded_X[e_c] + jnp.arange(N) - start[e_c], nb * b)
  pos_N = jnp.zeros_like(dest_N).at[order_N].set(dest_N)  # row n's block slot (nb * b: padding, dropped)
  src_Q = jnp.full((nb * b + 1,), N, jnp.int32).at[pos_N].set(jnp.arange(N, dtype=jnp.int32))[:-1]  # N: empty
  src_Q, keep_Q, kept_N = jnp.minimum(src_Q, N - 1), src_Q < N, pos_N < nb * b
  x_blocks = move(rows_NxD, src_Q, keep_Q, pos_N[:, None], kept_N[:, None]).reshape(nb, b, D)
  block_e = jnp.minimum(jnp.searchsorted(pend_X, jnp.arange(nb) * b, side="right"), experts - 1)
  if not skip_empty or fp8_mode != "none":
    # each weight is quantized whole (its per-tensor scale), then gathered per block
    mm = lambda spec, x, w: fp8.matmul(fp8_mode, lambda a, b: jnp.einsum(spec, a, b[block_e]), x, w)  # noqa: E731
    g = mm("nbd,ndf->nbf", x_blocks, w_gate_XxDxF)
    u = mm("nbd,ndf->nbf", x_blocks, w_up_XxDxF)
    y = mm("nbf,nfd->nbd", jax.nn.silu(g) * u, w_down_XxFxD)
  else:
    used = pend_X[-1]  # rows in use; empty blocks are skipped, in the backward pass too

    @jax.checkpoint  # else the loop's backward keeps each block's weight slices: (blocks, D, F) per weight
    def one(args):
      x_bxD, e, first = args
      swiglu = lambda _: jax.nn.silu(x_bxD @ w_gate_XxDxF[e]) * (x_bxD @ w_up_XxDxF[e]) @ w_down_XxFxD[e]  # noqa: E731
      return jax.lax.cond(first < used, swiglu, lambda _: jnp.zeros_like(x_bxD), None)
    y = jax.lax.map(one, (x_blocks, block_e, jnp.arange(nb) * b))
  return move(y.reshape(nb * b, D), jnp.minimum(pos_N, nb * b - 1), kept_N, src_Q[:, None], keep_Q[:, None])


def _local(x_TxD, idx_Txk, w_Txk, weights, ep: int, impl: str, axis: str = "expert", fp8_mode: str = "none"):
  """This device's tokens -> their MoE output (T, D) float32; ep > 1 inside a shard_map."""
  T, k = idx_Txk.shape
  X = weights[0].shape[0] * ep
  flat_N = idx_Txk.reshape(-1)  # assignment a = token a // k, choice a % k
  if ep == 1:
    y_NxD = grouped_ffn(jnp.repeat(x_TxD, k, axis=0), flat_N, X, *weights, impl=impl, fp8_mode=fp8_mode)
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
    send = move(x_TxD, src_S // k, keep_S, slot_N.reshape(T, k), jnp.ones((T, k), bool)).reshape(ep, bound, -1)
    ids = jnp.where(keep_S, flat_N[src_S] % Xl, Xl).reshape(ep, bound)
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # (source device, bound, D) for our experts
    recv_ids = jax.lax.all_to_all(ids, axis, 0, 0)
    out = grouped_ffn(recv.reshape(ep * bound, -1), recv_ids.reshape(-1), Xl, *weights, impl=impl, skip_empty=True,
                      fp8_mode=fp8_mode)
    back = jax.lax.all_to_all(out.reshape(ep, bound, -1), axis, 0, 0)  # (destination device, bound, D)
    y_NxD = move(back.reshape(ep * bound, -1), slot_N, jnp.ones(slot_N.shape, bool), src_S[:, None],
                 keep_S[:, None])
  return jnp.einsum("tkd,tk->td", y_NxD.reshape(T, k, -1).astype(jnp.float32), w_Txk)


def ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, plan):
  """Dropless MoE output (B, L, D) float32; weights (X,D,F),(X,D,F),(X,F,D); kernel and mesh are the plan's."""
  impl, axis, mesh = plan.moe_kernel, plan.expert_axis, moe_layout.dispatch_mesh(plan)
  ep = 1 if mesh is None else mesh.shape[axis]

  def local(x_bxnxD, idx_bxnxk, w_bxnxk, *ws):
    b, n, D = x_bxnxD.shape
    k = idx_bxnxk.shape[-1]
    return _local(x_bxnxD.reshape(b * n, D), idx_bxnxk.reshape(b * n, k), w_bxnxk.reshape(b * n, k), ws, ep, impl,
                  axis, plan.fp8).reshape(b, n, D)
  if mesh is None:
    return local(x_BxLxD, idx_BxLxk, w_BxLxk, *weights)
  tok_spec, w_spec = moe_layout.token_spec(mesh, *x_BxLxD.shape[:2], plan.rules), P(axis, None, None)
  return sharding.manual(local, mesh, (tok_spec,) * 3 + (w_spec,) * 3, tok_spec)(x_BxLxD, idx_BxLxk, w_BxLxk, *weights)
