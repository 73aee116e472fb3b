"""Blocked attention with an online softmax, plain math: the block pieces ring attention folds its K/V blocks with
(jaxtrain.parallel.ring), and `attention`, the one-device kernel that never holds L x L: query blocks over the key
blocks they may see (causal, within a window), sinks seeding the softmax, segment masks, and a custom VJP that
recomputes each block's probabilities from the saved log-sum-exp (flash-attention style)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.model import attention as attention_lib

NEG_INF = attention_lib.NEG_INF
BLOCK = 512  # tokens per query and key block: a head's float32 scores of one block pair are 1 MiB


def block_size(L: int) -> int:
  """Tokens per block for sequences of `L`: BLOCK, or a quarter of a shorter sequence (at least 1), so that a run
  that asks for this kernel at a short length still folds several blocks."""
  return max(1, min(BLOCK, L // 4))


def mask(idx_q, seg_q, idx_k, seg_k, window: int = 0):
  """(b, nq, 1, 1, nk): causal by global position (within `window`, 0: no limit), and same segment."""
  causal = attention_lib.visible(idx_q[:, None], idx_k[None, :], window)
  same = seg_q[:, :, None] == seg_k[:, None, :]
  return (causal[None] & same)[:, :, None, None, :]


def scores(q, k, allowed):
  """q (b,nq,K,G,E) x k (b,nk,K,E) -> masked float32 scores (b,nq,K,G,nk)."""
  s = jnp.einsum("bnkge,bmke->bnkgm", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
  return jnp.where(allowed, s, NEG_INF)


def start(shape: tuple, sinks, width: int):
  """The online softmax's (m, l, acc) before any key, for queries of `shape` (b, n, K, G): a sink starts the
  denominator (exp(sink - m) = 1 at m = sink); without one, nothing does. `width`: v's head width (MLA's may
  differ from q's)."""
  if sinks is None:
    m, l = jnp.full(shape, NEG_INF, jnp.float32), jnp.zeros(shape, jnp.float32)
  else:
    m, l = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(shape[2:]), shape), jnp.ones(shape, jnp.float32)
  return m, l, jnp.zeros((*shape, width), jnp.float32)


def fold(stats, q, k, v, allowed):
  """Online softmax: folds one key/value block into (m, l, acc)."""
  m, l, acc = stats
  s = scores(q, k, allowed)
  m_new = jnp.maximum(m, s.max(-1))
  corr = jnp.exp(m - m_new)
  p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
  pv = jnp.einsum("bnkgm,bmke->bnkge", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


def grad_block(q, k, v, do, lse, delta, allowed):
  """Gradients of one (query block, key block) pair: (dq, dk, dv), float32."""
  scale = q.shape[-1] ** -0.5
  p = jnp.where(allowed, jnp.exp(scores(q, k, allowed) - lse[..., None]), 0.0)
  dv = jnp.einsum("bnkgm,bnkge->bmke", p, do)
  dp = jnp.einsum("bnkge,bmke->bnkgm", do, v.astype(jnp.float32))
  ds = p * (dp - delta[..., None]) * scale
  dq = jnp.einsum("bnkgm,bmke->bnkge", ds, k.astype(jnp.float32))
  dk = jnp.einsum("bnkgm,bnkge->bmke", ds, q.astype(jnp.float32))
  return dq, dk, dv


def sink_grad(sinks, lse, delta):
  """A sink's logit only divides: d sink = -sum over the queries (b, n, K, G) of its probability times delta."""
  if sinks is None:
    return None
  K, G = lse.shape[2:]
  p = jnp.exp(sinks.astype(jnp.float32).reshape(K, G) - lse)
  return (-p * delta).sum((0, 1)).reshape(K * G).astype(sinks.dtype)


def attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, window: int = 0, sinks_H=None, block: int = 0):
  """Causal GQA within segments (a `window` > 0: the last `window` keys, itself included; `sinks_H`: a per-head
  logit in the denominator), as `attention_lib.attention` computes it, in blocks of `block` tokens (0:
  `block_size`): float32 statistics, at most one block pair of scores at a time, key blocks no query of a block
  can see never computed. L not a multiple of the block is padded at the end (causality hides the padding)."""
  L = q_BxLxHxE.shape[1]
  c = block or block_size(L)
  pad = -L % c
  if pad:
    q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL = (
        jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL))
  return _blocked(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, sinks_H, window, c)[:, :L]


def _varying(tree, *like):
  """`tree` (a loop's initial carry, made of constants) varying over every manual mesh axis that `like` varies
  over: inside a shard_map that checks it (ulysses'), a loop's carry keeps one type."""
  vma = lambda x: getattr(getattr(jax.typeof(x), "mat", None), "varying", frozenset())  # noqa: E731
  axes = frozenset().union(*(vma(x) for x in jax.tree.leaves(like)))
  def cast(x):
    missing = tuple(sorted(axes - vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(cast, tree)


def _slice(x, i, c: int):
  return jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1)


def _key_blocks(i, c: int, window: int):
  """The first key block a query block `i` can see (keys after its last query are never seen: blocks up to i)."""
  return 0 if not window else jnp.maximum(0, (i * c - window + 1) // c)


def _query_blocks(j, c: int, n: int, window: int):
  """One past the last query block that can see key block `j` (the first is j)."""
  return n if not window else jnp.minimum(n, (j * c + c + window - 2) // c + 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _blocked(q, k, v, seg, sinks, window: int, c: int):
  return _blocked_fwd(q, k, v, seg, sinks, window, c)[0]


def _blocked_fwd(q, k, v, seg, sinks, window: int, c: int):
  b, L, H, E = q.shape
  K = k.shape[2]
  n, pos = L // c, jnp.arange(L)
  q5 = q.reshape(b, L, K, H // K, E)

  def query_block(i):  # one query block folds the key blocks it may see; the diagonal shows each query itself
    qi, segi, posi = _slice(q5, i, c), _slice(seg, i, c), jax.lax.dynamic_slice_in_dim(pos, i * c, c)

    def one(j, stats):
      return fold(stats, qi, _slice(k, j, c), _slice(v, j, c),
                  mask(posi, segi, jax.lax.dynamic_slice_in_dim(pos, j * c, c), _slice(seg, j, c), window))
    stats = _varying(start((b, c, K, H // K), sinks, v.shape[-1]), q, k, v, seg, sinks)
    m, l, acc = jax.lax.fori_loop(_key_blocks(i, c, window), i + 1, one, stats)
    return acc / l[..., None], m + jnp.log(l)
  o_nxbxc, lse_nxbxc = jax.lax.map(query_block, jnp.arange(n))
  whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, L, *x.shape[3:])  # noqa: E731  (n, b, c, ...) -> (b, L, ...)
  out = whole(o_nxbxc).reshape(b, L, H, -1).astype(q.dtype)
  return out, (q, k, v, seg, sinks, out, whole(lse_nxbxc))


def _blocked_bwd(window: int, c: int, res, do):
  q, k, v, seg, sinks, out, lse = res
  b, L, H, E = q.shape
  K = k.shape[2]
  n, pos = L // c, jnp.arange(L)
  q5 = q.reshape(b, L, K, H // K, E)
  do5 = do.reshape(*q5.shape[:-1], -1).astype(jnp.float32)
  delta = jnp.sum(do5 * out.reshape(do5.shape).astype(jnp.float32), axis=-1)

  def key_block(dq, j):  # one key block against the query blocks that can see it: its dk, dv; their dq added
    kj, vj, segj = _slice(k, j, c), _slice(v, j, c), _slice(seg, j, c)
    posj = jax.lax.dynamic_slice_in_dim(pos, j * c, c)

    def one(i, carry):
      dq, dk, dv = carry
      gq, gk, gv = grad_block(_slice(q5, i, c), kj, vj, _slice(do5, i, c), _slice(lse, i, c), _slice(delta, i, c),
                              mask(jax.lax.dynamic_slice_in_dim(pos, i * c, c), _slice(seg, i, c), posj, segj, window))
      return jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i, c) + gq, i * c, axis=1), dk + gk, dv + gv
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dk, dv = _varying((zeros(kj), zeros(vj)), q, k, v, seg, do)
    dq, dk, dv = jax.lax.fori_loop(j, _query_blocks(j, c, n, window), one, (dq, dk, dv))
    return dq, (dk, dv)
  dq0 = _varying(jnp.zeros(q5.shape, jnp.float32), q, k, v, seg, do)
  dq, (dk_nxbxc, dv_nxbxc) = jax.lax.scan(key_block, dq0, jnp.arange(n))
  whole = lambda x, like: jnp.moveaxis(x, 0, 1).reshape(like.shape).astype(like.dtype)  # noqa: E731
  return (dq.reshape(q.shape).astype(q.dtype), whole(dk_nxbxc, k), whole(dv_nxbxc, v), None,
          sink_grad(sinks, lse, delta))


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
