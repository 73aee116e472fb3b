"""Ring attention over the `sequence` axis: K/V blocks travel the ring by `ppermute`, folded by an online
softmax (the block math of jaxtrain.model.flash, which the one-device blocked kernel shares); a custom VJP rotates
them again with their gradients. Zig-zag: device j holds chunks j and 2sp-1-j."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtrain.model import flash
from jaxtrain.parallel import sharding


def ring_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, plan, zigzag: bool = True, window: int = 0,
                   sinks_H=None):
  """Causal GQA with segment masking, sharded over the plan's sequence axis (batch/heads as its rules say). A local
  layer's `window`: contiguous blocks (the zig-zag balances causal work a window already balances), and only the
  ring steps whose blocks hold a visible key run (`ring_steps`): the rest are neither sent nor computed.
  `sinks_H`: the sink logits start each query's online softmax."""
  mesh, AXIS = plan.mesh, plan.sequence_axis
  sp = mesh.shape[AXIS]
  zigzag = zigzag and not window and q_BxLxHxE.shape[1] % (2 * sp) == 0
  kv_spec = plan.spec(("batch", "length", "act_kv_heads", None), k_BxLxKxE.shape)
  q_spec = plan.spec(("batch", "length", "act_heads", None), q_BxLxHxE.shape)
  # A query head must find its kv head on the same device: shard heads only if both divide.
  q_spec = kv_spec = P(kv_spec[0], kv_spec[1], kv_spec[2] if q_spec[2] == kv_spec[2] else None, None)
  if q_spec[1] != AXIS:
    raise ValueError(f"ring attention needs the length axis on {AXIS!r}; got spec {q_spec}")
  steps = ring_steps(q_BxLxHxE.shape[1] // sp, sp, window)
  body = functools.partial(_ring_local, axis=AXIS, sp=sp, zigzag=zigzag, window=window, steps=steps)
  sinks = () if sinks_H is None else (sinks_H,)
  return sharding.manual(body, mesh, (q_spec, kv_spec, kv_spec, P(*q_spec[:2]), *(P(q_spec[2]),) * len(sinks)),
                         q_spec)(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, *sinks)


def ring_steps(n: int, sp: int, window: int) -> int:
  """Ring steps after the diagonal block that can hold a visible key, for blocks of `n` contiguous tokens: step t
  brings keys at least (t - 1) n + 1 positions back, seen only within the window (all sp - 1 without one)."""
  return sp - 1 if not window else min(sp - 1, -(-(window - 1) // n))


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


def _ring_local(q, k, v, seg, *sinks, axis: str, sp: int, zigzag: bool, window: int, steps: int):
  n = q.shape[1]
  j = jax.lax.axis_index(axis)
  if zigzag:
    q, k, v, seg = (_to_zigzag(x, axis, sp) for x in (q, k, v, seg))
    c = n // 2
    idx = jnp.concatenate([j * c + jnp.arange(c), (2 * sp - 1 - j) * c + jnp.arange(c)])  # global positions
  else:
    idx = j * n + jnp.arange(n)
  out = _ring_core(q, k, v, seg, idx, sinks[0] if sinks else None, axis, sp, zigzag, window, steps)
  return _from_zigzag(out, axis, sp) if zigzag else out


def _steps(acc, blk, fold, n: int, axis: str, sp: int, zigzag: bool, window: int, steps: int):
  """The diagonal block, then ring steps 1..`steps`: `blk` moves one device on, then `fold(acc, blk, pairs) -> (acc,
  blk)` adds the causally visible part of each (q rows, k rows) pair (the block at step t comes from device j - t)."""
  j = jax.lax.axis_index(axis)
  every, first, second = slice(None), slice(0, n // 2), slice(n // 2, n)
  acc, blk = fold(acc, blk, tiles(n, 0, window))
  for t in range(1, steps + 1):
    blk = _rotate(blk, axis, sp)
    if zigzag:
      acc, blk = jax.lax.cond((j - t) % sp < j, lambda: fold(acc, blk, [(every, first)]),
                              lambda: fold(acc, blk, [(second, every)]))
    else:
      acc, blk = jax.lax.cond((j - t) % sp < j, lambda t=t: fold(acc, blk, tiles(n, t * n, window)),
                              lambda: (acc, blk))
  return acc, blk


def tiles(n: int, offset: int, window: int) -> list[tuple[slice, slice]]:
  """(query rows, key rows) of a block of `n` queries over `n` keys `offset` positions before them that can hold a
  visible pair: all of it without a window; with one, query tiles of about the window, each with the contiguous
  keys it may see (tiles wholly outside the window are never computed)."""
  if not window or window >= n + offset:
    return [(slice(None), slice(None))]
  size = min(d for d in range(1, n + 1) if n % d == 0 and d >= max(min(window, n), n // 16))  # at most 16 tiles
  out = []
  for a in range(0, n, size):  # query rows a..a+size-1 at a + offset see keys k with 0 <= a + offset - k < window
    lo, hi = max(0, a + offset - window + 1), min(n, a + size + offset)
    if lo < hi:
      out.append((slice(a, a + size), slice(lo, hi)))
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _ring_core(q, k, v, seg, idx, sinks, axis, sp, zigzag, window, steps):
  return _ring_fwd(q, k, v, seg, idx, sinks, axis, sp, zigzag, window, steps)[0]


def _ring_fwd(q, k, v, seg, idx, sinks, axis, sp, zigzag, window, steps):
  b, n, H, E = q.shape
  K = k.shape[2]
  q5 = q.reshape(b, n, K, H // K, E)
  shape = (b, n, K, H // K)
  stats = flash.start(shape, sinks, v.shape[-1])
  def fold(stats, blk, pairs):  # step 0 (the device's own block) shows every query at least itself
    kb, vb, segb, idxb = blk
    for qs, ks in pairs:
      part = flash.fold(jax.tree.map(lambda x: x[:, qs], stats), q5[:, qs], kb[:, ks], vb[:, ks],
                        flash.mask(idx[qs], seg[:, qs], idxb[ks], segb[:, ks], window))
      stats = jax.tree.map(lambda x, p: x.at[:, qs].set(p), stats, part)
    return stats, blk
  (m, l, acc), _ = _steps(stats, (k, v, seg, idx), fold, n, axis, sp, zigzag, window, steps)
  out = (acc / l[..., None]).reshape(b, n, H, -1).astype(q.dtype)
  return out, (q, k, v, seg, idx, sinks, out, m + jnp.log(l))


def _ring_bwd(axis, sp, zigzag, window, steps, res, do):
  q, k, v, seg, idx, sinks, out, lse = res
  b, n, H, E = q.shape
  K = k.shape[2]
  q5 = q.reshape(b, n, K, H // K, E)
  do5 = do.reshape(*q5.shape[:-1], -1).astype(jnp.float32)
  delta = jnp.sum(do5 * out.reshape(do5.shape).astype(jnp.float32), axis=-1)

  def fold(dq, blk, pairs):  # dk, dv travel with their K/V; `steps` hops on, one permute takes them home
    kb, vb, segb, idxb, dk, dv = blk
    for qs, ks in pairs:
      gq, gk, gv = flash.grad_block(q5[:, qs], kb[:, ks], vb[:, ks], do5[:, qs], lse[:, qs], delta[:, qs],
                                    flash.mask(idx[qs], seg[:, qs], idxb[ks], segb[:, ks], window))
      dq, dk, dv = dq.at[:, qs].add(gq), dk.at[:, ks].add(gk), dv.at[:, ks].add(gv)
    return dq, (kb, vb, segb, idxb, dk, dv)
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
  dq, (*_, dk, dv) = _steps(zeros(q5), (k, v, seg, idx, zeros(k), zeros(v)), fold, n, axis, sp, zigzag, window,
                            steps)
  if steps:
    dk, dv = jax.lax.ppermute((dk, dv), axis, [(i, (i - steps) % sp) for i in range(sp)])
  dsinks = flash.sink_grad(sinks, lse, delta)  # this device's rows; the region's transpose sums the devices
  return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks


_ring_core.defvjp(_ring_fwd, _ring_bwd)
