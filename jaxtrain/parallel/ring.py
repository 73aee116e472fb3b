"""Ring attention over the `sequence` axis: K/V blocks travel the ring by `ppermute`, folded by an online
softmax; a custom VJP rotates them again with their gradients. Zig-zag: device j holds chunks j and 2sp-1-j."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.parallel import sharding

NEG_INF = -1e30


def ring_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, plan, zigzag: bool = True):
  """Causal GQA with segment masking, sharded over the plan's sequence axis (batch/heads as its rules say)."""
  mesh, AXIS = plan.mesh, plan.sequence_axis
  sp = mesh.shape[AXIS]
  zigzag = zigzag and q_BxLxHxE.shape[1] % (2 * sp) == 0
  kv_spec = plan.spec(("batch", "length", "act_kv_heads", None), k_BxLxKxE.shape)
  q_spec = plan.spec(("batch", "length", "act_heads", None), q_BxLxHxE.shape)
  # A query head must find its kv head on the same device: shard heads only if both divide.
  q_spec = kv_spec = P(kv_spec[0], kv_spec[1], kv_spec[2] if q_spec[2] == kv_spec[2] else None, None)
  if q_spec[1] != AXIS:
    raise ValueError(f"ring attention needs the length axis on {AXIS!r}; got spec {q_spec}")
  body = functools.partial(_ring_local, axis=AXIS, sp=sp, zigzag=zigzag)
  return sharding.manual(body, mesh, (q_spec, kv_spec, kv_spec, P(*q_spec[:2])), q_spec)(
      q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)


def _to_zigzag(x, axis: str, sp: int):
  """Contiguous block (chunks 2j, 2j+1) on device j -> zig-zag (chunks j, 2sp-1-j), along axis 1."""
  c = x.shape[1] // 2
  dest = lambda m: m if m < sp else 2 * sp - 1 - m  # noqa: E731  device of global chunk m
  from_even = jax.lax.ppermute(x[:, :c], axis, [(i, dest(2 * i)) for i in range(sp)])
  from_odd = jax.lax.ppermute(x[:, c:], axis, [(i, dest(2 * i + 1)) for i in range(sp)])
  even_j = (jax.lax.axis_index(axis) % 2) == 0  # our chunk with an even global index came via from_even
  return jnp.concatenate([jnp.where(even_j, from_even, from_odd), jnp.where(even_j, from_odd, from_even)], axis=1)


def _from_zigzag(y, axis: str, sp: int):
  """Inverse of `_to_zigzag`."""
  c = y.shape[1] // 2
  even_j = (jax.lax.axis_index(axis) % 2) == 0  # device j holds chunks j and 2sp-1-j: one even, one odd
  even_chunk = lambda i: i if i % 2 == 0 else 2 * sp - 1 - i  # noqa: E731
  half0 = jax.lax.ppermute(jnp.where(even_j, y[:, :c], y[:, c:]), axis, [(i, even_chunk(i) // 2) for i in range(sp)])
  half1 = jax.lax.ppermute(jnp.where(even_j, y[:, c:], y[:, :c]), axis,
                           [(i, (2 * sp - 1 - even_chunk(i)) // 2) for i in range(sp)])
  return jnp.concatenate([half0, half1], axis=1)


def _rotate(tree, axis: str, sp: int):
  return jax.lax.ppermute(tree, axis, [(i, (i + 1) % sp) for i in range(sp)])


def _ring_local(q, k, v, seg, *, axis: str, sp: int, zigzag: bool):
  n = q.shape[1]
  j = jax.lax.axis_index(axis)
  if zigzag:
    q, k, v, seg = (_to_zigzag(x, axis, sp) for x in (q, k, v, seg))
    c = n // 2
    idx = jnp.concatenate([j * c + jnp.arange(c), (2 * sp - 1 - j) * c + jnp.arange(c)])  # global positions
  else:
    idx = j * n + jnp.arange(n)
  out = _ring_core(q, k, v, seg, idx, axis, sp, zigzag)
  return _from_zigzag(out, axis, sp) if zigzag else out


def _mask(idx_q, seg_q, idx_k, seg_k):
  """(b, nq, 1, 1, nk): causal by global index, and same segment."""
  causal = idx_q[:, None] >= idx_k[None, :]
  same = seg_q[:, :, None] == seg_k[:, None, :]
  return (causal[None] & same)[:, :, None, None, :]


def _scores(q, k, mask):
  """q (b,nq,K,G,E) x k (b,nk,K,E) -> masked float32 scores (b,nq,K,G,nk)."""
  s = jnp.einsum("bnkge,bmke->bnkgm", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
  return jnp.where(mask, s, NEG_INF)


def _fold(stats, q, k, v, mask):
  """Online softmax: folds one key/value block into (m, l, acc)."""
  m, l, acc = stats
  s = _scores(q, k, mask)
  m_new = jnp.maximum(m, s.max(-1))
  corr = jnp.exp(m - m_new)
  p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
  pv = jnp.einsum("bnkgm,bmke->bnkge", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv


def _grad_block(q, k, v, do, lse, delta, mask):
  """Gradients of one (query block, key block) pair: (dq, dk, dv), float32."""
  scale = q.shape[-1] ** -0.5
  p = jnp.where(mask, jnp.exp(_scores(q, k, mask) - lse[..., None]), 0.0)
  dv = jnp.einsum("bnkgm,bnkge->bmke", p, do)
  dp = jnp.einsum("bnkge,bmke->bnkgm", do, v.astype(jnp.float32))
  ds = p * (dp - delta[..., None]) * scale
  dq = jnp.einsum("bnkgm,bmke->bnkge", ds, k.astype(jnp.float32))
  dk = jnp.einsum("bnkgm,bnkge->bmke", ds, q.astype(jnp.float32))
  return dq, dk, dv


def _steps(acc, blk, fold, n: int, axis: str, sp: int, zigzag: bool):
  """Ring steps 1..sp-1: `blk` moves one device on, then `fold(acc, blk, q rows, k rows) -> (acc, blk)`
  adds its causally visible part (the block at step t comes from device j - t)."""
  j = jax.lax.axis_index(axis)
  every, first, second = slice(None), slice(0, n // 2), slice(n // 2, n)
  for t in range(1, sp):
    blk = _rotate(blk, axis, sp)
    if zigzag:
      acc, blk = jax.lax.cond((j - t) % sp < j, lambda: fold(acc, blk, every, first),
                              lambda: fold(acc, blk, second, every))
    else:
      acc, blk = jax.lax.cond((j - t) % sp < j, lambda: fold(acc, blk, every, every), lambda: (acc, blk))
  return acc, blk


def _keys(blk, ks):
  """(k, v, segments, global index) rows `ks` of a travelling block."""
  k, v, seg, idx = blk[:4]
  return k[:, ks], v[:, ks], seg[:, ks], idx[ks]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring_core(q, k, v, seg, idx, axis, sp, zigzag):
  return _ring_fwd(q, k, v, seg, idx, axis, sp, zigzag)[0]


def _ring_fwd(q, k, v, seg, idx, axis, sp, zigzag):
  b, n, H, E = q.shape
  K = k.shape[2]
  q5 = q.reshape(b, n, K, H // K, E)
  stats = (jnp.full((b, n, K, H // K), NEG_INF, jnp.float32), jnp.zeros((b, n, K, H // K), jnp.float32),
           jnp.zeros((b, n, K, H // K, v.shape[-1]), jnp.float32))  # v's head width may differ (MLA)
  # Step 0: the device's own (diagonal) block; every query sees at least itself here.
  stats = _fold(stats, q5, k, v, _mask(idx, seg, idx, seg))

  def fold(stats, blk, qs, ks):
    kb, vb, segb, idxb = _keys(blk, ks)
    part = _fold(jax.tree.map(lambda x: x[:, qs], stats), q5[:, qs], kb, vb, _mask(idx[qs], seg[:, qs], idxb, segb))
    return jax.tree.map(lambda x, p: x.at[:, qs].set(p), stats, part), blk
  (m, l, acc), _ = _steps(stats, (k, v, seg, idx), fold, n, axis, sp, zigzag)
  out = (acc / l[..., None]).reshape(b, n, H, -1).astype(q.dtype)
  return out, (q, k, v, seg, idx, out, m + jnp.log(l))


def _ring_bwd(axis, sp, zigzag, res, do):
  q, k, v, seg, idx, out, lse = res
  b, n, H, E = q.shape
  K = k.shape[2]
  q5 = q.reshape(b, n, K, H // K, E)
  do5 = do.reshape(*q5.shape[:-1], -1).astype(jnp.float32)
  delta = jnp.sum(do5 * out.reshape(do5.shape).astype(jnp.float32), axis=-1)
  dq, dk, dv = _grad_block(q5, k, v, do5, lse, delta, _mask(idx, seg, idx, seg))

  def fold(dq, blk, qs, ks):  # dk, dv travel with their K/V; after sp hops they are home
    kb, vb, segb, idxb = _keys(blk, ks)
    gq, gk, gv = _grad_block(q5[:, qs], kb, vb, do5[:, qs], lse[:, qs], delta[:, qs],
                             _mask(idx[qs], seg[:, qs], idxb, segb))
    *kv, dk, dv = blk
    return dq.at[:, qs].add(gq), (*kv, dk.at[:, ks].add(gk), dv.at[:, ks].add(gv))
  dq, (*_, dk, dv) = _steps(dq, (k, v, seg, idx, dk, dv), fold, n, axis, sp, zigzag)
  dk, dv = _rotate((dk, dv), axis, sp)
  return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring_core.defvjp(_ring_fwd, _ring_bwd)
