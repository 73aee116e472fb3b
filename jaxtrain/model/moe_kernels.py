"""The routed experts' FFN on the tokens one device holds: capacity groups (slots, dispatch into per-expert buffers,
combine) and dropless grouped matmuls (ragged_dot, or blocks of rows of one expert each). jaxtrain.parallel's
expert dispatch runs the same pieces around its all_to_alls. `mm(spec, x, w)` / `project(fn, x, w, *args)` is how a
projection runs (the FP8 policy's; plain einsum by default). X experts, D d_model, F expert width, k top_k."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.model.activation import glu


def _einsum(spec, x, w):
  return jnp.einsum(spec, x, w)


def _plain(fn, x, w, *args):
  return fn(x, w, *args)


# --- capacity groups

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


def group_dispatch(x_bxnxD, idx_bxnxk, experts: int, cap: int, group: int):
  """This device's tokens in groups of `group` -> (buffers (X, groups x C, D), slot, keep, dropped count)."""
  b, n, D = x_bxnxD.shape
  k = idx_bxnxk.shape[-1]
  ng = b * n // group
  idx_gxGxk = idx_bxnxk.reshape(ng, group, k)
  slot, keep = jax.vmap(lambda i: slots(i, experts, cap))(idx_gxGxk)
  buf_gxXxCxD = jax.vmap(lambda x, i, s, kp: dispatch(x, i, s, kp, experts, cap))(
      x_bxnxD.reshape(ng, group, D), idx_gxGxk, slot, keep)
  return buf_gxXxCxD.swapaxes(0, 1).reshape(experts, ng * cap, D), slot, keep, jnp.sum(~keep).astype(jnp.float32)


def group_combine(out_XxMxD, idx_bxnxk, slot_gxGxk, keep_gxGxk, w_bxnxk):
  """Inverse of `group_dispatch` for the experts' outputs: (b, n, D) float32."""
  b, n, k = idx_bxnxk.shape
  X, _, D = out_XxMxD.shape
  ng, G = slot_gxGxk.shape[:2]
  out_gxXxCxD = out_XxMxD.reshape(X, ng, -1, D).swapaxes(0, 1)
  y = jax.vmap(combine)(out_gxXxCxD, idx_bxnxk.reshape(ng, G, k), slot_gxGxk, keep_gxGxk, w_bxnxk.reshape(ng, G, k))
  return y.reshape(b, n, D)


def biases(weights, pick):
  """The experts' (gate, up, down) biases at `pick` (an index into their expert axis), in `weights` (w_gate, w_up,
  w_down[, b_gate, b_up, b_down]: model.moe_bias); None each where the experts have none."""
  return tuple(b[pick] for b in weights[3:]) if len(weights) > 3 else (None, None, None)


def _add(y, b):
  return y if b is None else y + b.astype(y.dtype)


def swiglu(buf_XxNxD, weights, mm=_einsum, hidden=lambda h: h, act=None):
  """The gated FFN of every expert on its buffer (`weights`: see `biases`; `act`: activation.glu's); `hidden`
  annotates the (X, N, F) hidden."""
  w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD = weights[:3]
  b_gate, b_up, b_down = biases(weights, (slice(None), None))
  h_XxNxF = hidden(glu(_add(mm("xnd,xdf->xnf", buf_XxNxD, w_gate_XxDxF), b_gate),
                       _add(mm("xnd,xdf->xnf", buf_XxNxD, w_up_XxDxF), b_up), act))
  return _add(mm("xnf,xfd->xnd", h_XxNxF, w_down_XxFxD), b_down)


def capacity_ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, group: int, cap: int, mm=_einsum, act=None):
  """Capacity-group experts on one device: (y float32, dropped assignments)."""
  buf, slot, keep, dropped = group_dispatch(x_BxLxD, idx_BxLxk, weights[0].shape[0], cap, group)
  return group_combine(swiglu(buf, weights, mm, act=act), idx_BxLxk, slot, keep, w_BxLxk), dropped


# --- dropless: grouped matmuls

def grouped_ffn(rows_NxD, expert_N, experts: int, weights, impl: str = "ragged_dot", skip_empty: bool = False,
                project=None, act=None):
  """The gated FFN of each row through expert expert_N[i] (ids >= experts: padding, output 0); `weights`: see
  `biases`; `project` None: plain."""
  mm = project or _plain
  w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD = weights[:3]
  if experts == 1:  # one local expert (X = ep): plain matmuls, padding rows masked; no sort
    b_gate, b_up, b_down = biases(weights, 0)
    h = glu(_add(mm(jnp.matmul, rows_NxD, w_gate_XxDxF[0]), b_gate),
            _add(mm(jnp.matmul, rows_NxD, w_up_XxDxF[0]), b_up), act)
    return jnp.where((expert_N == 0)[:, None], _add(mm(jnp.matmul, h, w_down_XxFxD[0]), b_down), 0)
  if impl == "blocks":
    return blocked_ffn(rows_NxD, expert_N, experts, weights, skip_empty, project, act)
  order_N = jnp.argsort(expert_N, stable=True)
  inverse_N = jnp.argsort(order_N)
  sizes_X = jnp.zeros((experts + 1,), jnp.int32).at[jnp.minimum(expert_N, experts)].add(1)[:experts]
  x_NxD = rows_NxD[order_N]
  b_gate, b_up, b_down = biases(weights, jnp.minimum(expert_N[order_N], experts - 1))  # padding rows: masked below
  g_NxF = _add(mm(jax.lax.ragged_dot, x_NxD, w_gate_XxDxF, sizes_X), b_gate)
  u_NxF = _add(mm(jax.lax.ragged_dot, x_NxD, w_up_XxDxF, sizes_X), b_up)
  y_NxD = _add(mm(jax.lax.ragged_dot, glu(g_NxF, u_NxF, act), w_down_XxFxD, sizes_X), b_down)
  valid_N = jnp.arange(rows_NxD.shape[0]) < jnp.sum(sizes_X)  # rows past every group: padding
  return jnp.where(valid_N[:, None], y_NxD, 0)[inverse_N]


def grouped_ffn_BxL(x_BxLxD, idx_BxLxk, w_BxLxk, weights, impl: str, project=None, act=None):
  """Dropless experts on one device: every token's k choices through `grouped_ffn`, weighted; (B, L, D) float32."""
  B, L, D = x_BxLxD.shape
  k = idx_BxLxk.shape[-1]
  y_NxD = grouped_ffn(jnp.repeat(x_BxLxD.reshape(B * L, D), k, axis=0), idx_BxLxk.reshape(-1), weights[0].shape[0],
                      weights, impl=impl, project=project, act=act)
  y_TxD = jnp.einsum("tkd,tk->td", y_NxD.reshape(B * L, k, D).astype(jnp.float32), w_BxLxk.reshape(B * L, k))
  return y_TxD.reshape(B, L, D)


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


def _block_layout(expert_N, experts: int, b: int, nb: int):
  """Rows sorted into blocks of b rows of one expert: (row n's slot pos_N (nb*b: dropped), each slot's source row
  src_Q (clipped) and whether it holds one, whether row n has a slot, each block's expert, rows in use)."""
  N = expert_N.shape[0]
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
  block_e = jnp.minimum(jnp.searchsorted(pend_X, jnp.arange(nb) * b, side="right"), experts - 1)
  return pos_N, jnp.minimum(src_Q, N - 1), src_Q < N, pos_N < nb * b, block_e, pend_X[-1]


def blocked_ffn(rows_NxD, expert_N, experts: int, weights, skip_empty: bool = False, project=None, act=None):
  """`grouped_ffn` over blocks of b rows of one expert each: one batched matmul, or (skip_empty) a loop that
  skips the blocks past the rows in use (not with a `project` of its own, e.g. FP8: a scale's pmax cannot sit in
  a branch some devices skip)."""
  N, D = rows_NxD.shape
  w_gate_XxDxF, w_up_XxDxF, w_down_XxFxD = weights[:3]
  b = max(8, 1 << max(0, (N // (4 * experts)).bit_length() - 1))  # power of two near N / 4X: padding ~N/4
  nb = -(-(N + experts * (b - 1)) // b)
  pos_N, src_Q, keep_Q, kept_N, block_e, used = _block_layout(expert_N, experts, b, nb)
  x_blocks = move(rows_NxD, src_Q, keep_Q, pos_N[:, None], kept_N[:, None]).reshape(nb, b, D)
  if not skip_empty or project is not None:
    # each weight goes through `project` whole (an FP8 per-tensor scale), then is gathered per block
    mm = lambda spec, x, w: (project or _plain)(lambda a, c: jnp.einsum(spec, a, c[block_e]), x, w)  # noqa: E731
    b_gate, b_up, b_down = biases(weights, (block_e, None))
    g = _add(mm("nbd,ndf->nbf", x_blocks, w_gate_XxDxF), b_gate)
    u = _add(mm("nbd,ndf->nbf", x_blocks, w_up_XxDxF), b_up)
    y = _add(mm("nbf,nfd->nbd", glu(g, u, act), w_down_XxFxD), b_down)
  else:
    @jax.checkpoint  # else the loop's backward keeps each block's weight slices: (blocks, D, F) per weight
    def one(args):
      x_bxD, e, first = args
      b_gate, b_up, b_down = biases(weights, e)

      def ffn(_):
        h = glu(_add(x_bxD @ w_gate_XxDxF[e], b_gate), _add(x_bxD @ w_up_XxDxF[e], b_up), act)
        return _add(h @ w_down_XxFxD[e], b_down)
      return jax.lax.cond(first < used, ffn, lambda _: jnp.zeros_like(x_bxD), None)
    y = jax.lax.map(one, (x_blocks, block_e, jnp.arange(nb) * b))
  return move(y.reshape(nb * b, D), jnp.minimum(pos_N, nb * b - 1), kept_N, src_Q[:, None], keep_Q[:, None])
