"""Ring attention over the `sequence` mesh axis: a `shard_map` with explicit `ppermute`s.

Each device keeps its query block; key/value blocks travel around the ring (device j
sends to j+1), and an online (flash-style) softmax folds each visiting block into a
running max `m`, normalizer `l` and accumulator `acc`. The backward pass is a custom
VJP that rotates K/V again, with their gradient accumulators travelling alongside, so a
device never holds more than its own block plus one visiting block: memory O(L / sp),
never a full-length K/V.

Load balance (zig-zag): the sequence is cut into 2*sp chunks and device j holds chunks
j and 2*sp-1-j, so every device has as many early as late queries. At ring step t >= 1
exactly half of the (query chunk, key chunk) pairs are causally visible, and only that
half is computed: all queries against the first key chunk when the block comes from an
earlier device, the second query chunk against all keys otherwise. The data arrive in
contiguous blocks; a `ppermute` pair reorders q/k/v/segments into zig-zag order and one
pair restores the output order.

Shapes (local to one device): b batch, n local length, c = n/2 chunk, K kv heads,
G queries per kv head, E head dim. Masks use global token indices, so causality and
segment isolation hold exactly whatever blocks are skipped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

NEG_INF = -1e30


def ring_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, plan, zigzag: bool = True):
  """Causal GQA with segment masking, sharded over the plan's sequence axis (and
  batch/heads as the plan's rules say)."""
  mesh, AXIS = plan.mesh, plan.sequence_axis
  sp = mesh.shape[AXIS]
  L = q_BxLxHxE.shape[1]
  zigzag = zigzag and L % (2 * sp) == 0
  kv_spec = plan.spec(("batch", "length", "act_kv_heads", None), k_BxLxKxE.shape)
  q_spec = plan.spec(("batch", "length", "act_heads", None), q_BxLxHxE.shape)
  # A query head must find its kv head on the same device: shard heads only if both divide.
  q_spec = P(kv_spec[0], kv_spec[1], kv_spec[2] if q_spec[2] == kv_spec[2] else None, None)
  kv_spec = P(*q_spec[:2], q_spec[2], None)
  if q_spec[1] != AXIS:
    raise ValueError(f"ring attention needs the length axis on {AXIS!r}; got spec {q_spec}")
  seg_spec = P(q_spec[0], q_spec[1])
  body = functools.partial(_ring_local, axis=AXIS, sp=sp, zigzag=zigzag)
  # check_vma=False: the custom VJP and the per-device lax.cond carry values that vary
  # over `sequence` mixed with invariant initial values; shard_map's replication typing
  # would need pvary casts everywhere for no benefit (outputs are fully sharded).
  return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
                       out_specs=q_spec, check_vma=False)(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL)


# ----------------------------------------------------------------------------- layout

def _dest(m: int, sp: int) -> int:
  """Device holding global chunk m in zig-zag order."""
  return m if m < sp else 2 * sp - 1 - m


def _to_zigzag(x, axis: str, sp: int):
  """Contiguous block (chunks 2j, 2j+1) on device j -> zig-zag (chunks j, 2sp-1-j), along axis 1."""
  c = x.shape[1] // 2
  j = jax.lax.axis_index(axis)
  from_even = jax.lax.ppermute(x[:, :c], axis, [(i, _dest(2 * i, sp)) for i in range(sp)])
  from_odd = jax.lax.ppermute(x[:, c:], axis, [(i, _dest(2 * i + 1, sp)) for i in range(sp)])
  # Device j's two chunks: the one with an even global index came through `from_even`.
  even_j = (j % 2) == 0
  first = jnp.where(even_j, from_even, from_odd)
  second = jnp.where(even_j, from_odd, from_even)
  return jnp.concatenate([first, second], axis=1)


def _from_zigzag(y, axis: str, sp: int):
  """Inverse of `_to_zigzag`."""
  c = y.shape[1] // 2
  j = jax.lax.axis_index(axis)
  even_j = (j % 2) == 0
  send_even = jnp.where(even_j, y[:, :c], y[:, c:])
  send_odd = jnp.where(even_j, y[:, c:], y[:, :c])
  even_chunk = lambda i: i if i % 2 == 0 else 2 * sp - 1 - i  # noqa: E731
  odd_chunk = lambda i: 2 * sp - 1 - i if i % 2 == 0 else i  # noqa: E731
  half0 = jax.lax.ppermute(send_even, axis, [(i, even_chunk(i) // 2) for i in range(sp)])
  half1 = jax.lax.ppermute(send_odd, axis, [(i, odd_chunk(i) // 2) for i in range(sp)])
  return jnp.concatenate([half0, half1], axis=1)


def _global_index(n: int, axis: str, sp: int, zigzag: bool):
  """Global sequence index of each of this device's n local tokens."""
  j = jax.lax.axis_index(axis)
  if not zigzag:
    return j * n + jnp.arange(n)
  c = n // 2
  return jnp.concatenate([j * c + jnp.arange(c), (2 * sp - 1 - j) * c + jnp.arange(c)])


def _rotate(tree, axis: str, sp: int):
  return jax.lax.ppermute(tree, axis, [(i, (i + 1) % sp) for i in range(sp)])


def _ring_local(q, k, v, seg, *, axis: str, sp: int, zigzag: bool):
  n = q.shape[1]
  if zigzag:
    q, k, v, seg = (_to_zigzag(x, axis, sp) for x in (q, k, v, seg))
  idx = _global_index(n, axis, sp, zigzag)
  out = _ring_core(q, k, v, seg, idx, axis, sp, zigzag)
  return _from_zigzag(out, axis, sp) if zigzag else out


# ------------------------------------------------------------------------- the block math

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


def _rows(tree, sl):
  return jax.tree.map(lambda x: x[:, sl], tree)


def _put_rows(tree, sl, part):
  return jax.tree.map(lambda x, p: x.at[:, sl].set(p), tree, part)


def _step_plan(t: int, axis: str, sp: int, zigzag: bool):
  """At ring step t >= 1 the block comes from device s = j - t (mod sp). Returns
  (pred, (q rows, k rows) if pred, (q rows, k rows) if not); None rows = skip."""
  j = jax.lax.axis_index(axis)
  earlier = ((j - t) % sp) < j
  if zigzag:
    return earlier, (slice(None), "first"), ("second", slice(None))
  return earlier, (slice(None), slice(None)), None


def _resolve(sl, n):
  c = n // 2
  return {"first": slice(0, c), "second": slice(c, n)}.get(sl, sl) if isinstance(sl, str) else sl


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring_core(q, k, v, seg, idx, axis, sp, zigzag):
  return _ring_fwd(q, k, v, seg, idx, axis, sp, zigzag)[0]


def _ring_fwd(q, k, v, seg, idx, axis, sp, zigzag):
  b, n, H, E = q.shape
  K = k.shape[2]
  q5 = q.reshape(b, n, K, H // K, E)
  stats = (jnp.full((b, n, K, H // K), NEG_INF, jnp.float32), jnp.zeros((b, n, K, H // K), jnp.float32),
           jnp.zeros((b, n, K, H // K, E), jnp.float32))
  blk = (k, v, seg, idx)
  # Step 0: the device's own (diagonal) block; every query sees at least itself here.
  stats = _fold(stats, q5, k, v, _mask(idx, seg, idx, seg))
  for t in range(1, sp):
    blk = _rotate(blk, axis, sp)
    pred, yes, no = _step_plan(t, axis, sp, zigzag)

    def run(rows, stats=stats, blk=blk):
      if rows is None:
        return stats
      qs, ks = (_resolve(p, n) for p in rows)
      kb, vb, segb, idxb = blk[0][:, ks], blk[1][:, ks], blk[2][:, ks], blk[3][ks]
      part = _fold(_rows(stats, qs), q5[:, qs], kb, vb, _mask(idx[qs], seg[:, qs], idxb, segb))
      return _put_rows(stats, qs, part)

    stats = jax.lax.cond(pred, lambda yes=yes, run=run: run(yes), lambda no=no, run=run: run(no))
  m, l, acc = stats
  out = (acc / l[..., None]).reshape(b, n, H, E).astype(q.dtype)
  lse = m + jnp.log(l)
  return out, (q, k, v, seg, idx, out, lse)


def _ring_bwd(axis, sp, zigzag, res, do):
  q, k, v, seg, idx, out, lse = res
  b, n, H, E = q.shape
  K = k.shape[2]
  q5 = q.reshape(b, n, K, H // K, E)
  do5 = do.reshape(q5.shape).astype(jnp.float32)
  delta = jnp.sum(do5 * out.reshape(q5.shape).astype(jnp.float32), axis=-1)
  dq, dk, dv = _grad_block(q5, k, v, do5, lse, delta, _mask(idx, seg, idx, seg))
  blk = (k, v, seg, idx)
  for t in range(1, sp):
    # K/V and their gradient accumulators travel together; after sp hops dk/dv are home.
    blk, (dk, dv) = _rotate((blk, (dk, dv)), axis, sp)
    pred, yes, no = _step_plan(t, axis, sp, zigzag)

    def run(rows, grads=(dq, dk, dv), blk=blk):
      if rows is None:
        return grads
      qs, ks = (_resolve(p, n) for p in rows)
      kb, vb, segb, idxb = blk[0][:, ks], blk[1][:, ks], blk[2][:, ks], blk[3][ks]
      gq, gk, gv = _grad_block(q5[:, qs], kb, vb, do5[:, qs], lse[:, qs], delta[:, qs],
                               _mask(idx[qs], seg[:, qs], idxb, segb))
      dq_, dk_, dv_ = grads
      return dq_.at[:, qs].add(gq), dk_.at[:, ks].add(gk), dv_.at[:, ks].add(gv)

    dq, dk, dv = jax.lax.cond(pred, lambda yes=yes, run=run: run(yes), lambda no=no, run=run: run(no))
  dk, dv = _rotate((dk, dv), axis, sp)
  none_like = lambda x: None  # noqa: E731  integer inputs have no cotangent
  return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), none_like(seg),
          none_like(idx))


_ring_core.defvjp(_ring_fwd, _ring_bwd)
