"""Ring attention over the `sequence` axis: K/V blocks travel the ring by `ppermute`; a custom VJP rotates them
again with their gradients. Zig-zag: device j holds chunks j and 2sp-1-j. Each block pair is folded either by an
online softmax (the block math of jaxtrain.model.flash, which the one-device blocked kernel shares: segments,
windows, sinks) or by a kernel that returns the pair's output and log-sum-exp (`Blocks`: cuDNN on a GPU, where no
window or sink is asked for), merged by log-sum-exp."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtrain.model import flash
from jaxtrain.parallel import kernels, sharding


@dataclasses.dataclass(frozen=True)
class Blocks:
  """A kernel for one (query block, key block) pair: `forward(q, k, v, seg_q, seg_k, causal) -> (out, lse)` and
  `backward(q, k, v, seg_q, seg_k, out, do, lse, causal) -> (dq, dk, dv)` given the whole ring's out and lse,
  float32. `causal`: the diagonal pair (same positions); else every key is visible (to a query of its segment;
  segment ids None: rows of one document)."""
  forward: Callable
  backward: Callable


def ring_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, plan, zigzag: bool = True, window: int = 0,
                   sinks_H=None, blocks: Blocks | None = None):
  """Causal GQA with segment masking, sharded over the plan's sequence axis (batch/heads as its rules say). A local
  layer's `window`: contiguous blocks (the zig-zag balances causal work a window already balances), and only the
  ring steps whose blocks hold a visible key run (`ring_steps`): the rest are neither sent nor computed.
  `sinks_H`: the sink logits start each query's online softmax. `blocks`: a pair kernel (default: the plan's,
  `CUDNN` where it chose cuDNN pairs; else the online softmax), given segment ids unless the plan knows every row
  is one document (`packed_segments` 1)."""
  blocks = blocks or (CUDNN if plan.ring_kernel == "cudnn" else None)
  if blocks is not None and (window or sinks_H is not None):
    raise ValueError("ring attention's pair kernels take no window or sinks (the plan keeps the online softmax)")
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
  body = functools.partial(_ring_local, axis=AXIS, sp=sp, zigzag=zigzag, window=window, steps=steps, blocks=blocks,
                           masked=plan.packed_segments != 1)
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


def _ring_local(q, k, v, seg, *sinks, axis: str, sp: int, zigzag: bool, window: int, steps: int, blocks,
                masked: bool):
  n = q.shape[1]
  j = jax.lax.axis_index(axis)
  if zigzag:
    q, k, v, seg = (_to_zigzag(x, axis, sp) for x in (q, k, v, seg))
    c = n // 2
    idx = jnp.concatenate([j * c + jnp.arange(c), (2 * sp - 1 - j) * c + jnp.arange(c)])  # global positions
  else:
    idx = j * n + jnp.arange(n)
  if blocks is not None:  # local positions increase with global ones: the diagonal pair is causal as it stands
    out = _ring_pairs(q, k, v, seg if masked else None, axis, sp, zigzag, steps, blocks)
  else:
    out = _ring_core(q, k, v, seg, idx, sinks[0] if sinks else None, axis, sp, zigzag, window, steps)
  return _from_zigzag(out, axis, sp) if zigzag else out


def _steps(acc, blk, fold, n: int, axis: str, sp: int, zigzag: bool, window: int, steps: int):
  """The diagonal block, then ring steps 1..`steps`: `blk` moves one device on, then `fold(acc, blk, pairs,
  diagonal) -> (acc, blk)` adds the causally visible part of each (q rows, k rows) pair (the block at step t comes
  from device j - t; off the diagonal, every pair given is wholly visible without a window)."""
  j = jax.lax.axis_index(axis)
  every, first, second = slice(None), slice(0, n // 2), slice(n // 2, n)
  acc, blk = fold(acc, blk, tiles(n, 0, window), True)
  for t in range(1, steps + 1):
    blk = _rotate(blk, axis, sp)
    if zigzag:
      acc, blk = jax.lax.cond((j - t) % sp < j, lambda: fold(acc, blk, [(every, first)], False),
                              lambda: fold(acc, blk, [(second, every)], False))
    else:
      acc, blk = jax.lax.cond((j - t) % sp < j, lambda t=t: fold(acc, blk, tiles(n, t * n, window), False),
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
  def fold(stats, blk, pairs, diagonal):  # step 0 (the device's own block) shows every query at least itself
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

  def fold(dq, blk, pairs, diagonal):  # dk, dv travel with their K/V; `steps` hops on, one permute takes them home
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring_pairs(q, k, v, seg, axis, sp, zigzag, steps, blocks):
  return _pairs_fwd(q, k, v, seg, axis, sp, zigzag, steps, blocks)[0]


def _rows(seg, rows):
  return None if seg is None else seg[:, rows]


def _pairs_fwd(q, k, v, seg, axis, sp, zigzag, steps, blocks):
  """Each pair's (out, lse) from `blocks`, merged by log-sum-exp: out = sum_i out_i exp(lse_i - lse). `seg`: the
  segment ids, travelling with K/V (None: rows of one document)."""
  b, n, H, _ = q.shape
  def fold(acc, blk, pairs, diagonal):
    out, lse = acc
    kb, vb, segb = blk
    for qs, ks in pairs:
      pair = blocks.forward(q[:, qs], kb[:, ks], vb[:, ks], _rows(seg, qs), _rows(segb, ks), diagonal)
      o, s = merge(out[:, qs], lse[:, qs], *pair)
      out, lse = out.at[:, qs].set(o), lse.at[:, qs].set(s)
    return (out, lse), blk
  (out, lse), _ = _steps(nothing_yet(b, n, H, v.shape[-1]), (k, v, seg), fold, n, axis, sp, zigzag, 0, steps)
  out = out.astype(q.dtype)
  return out, (q, k, v, seg, out, lse)


def nothing_yet(b: int, n: int, H: int, width: int):
  """(out, lse) of queries that have met no key: merging a pair into it gives that pair."""
  return jnp.zeros((b, n, H, width), jnp.float32), jnp.full((b, n, H), -jnp.inf, jnp.float32)


def merge(out, lse, o, s):
  """Two softmaxes over disjoint keys as one: (out, lse) and a pair's (o, s), float32, weighted by their shares of
  the joint denominator (a query that has met no key on either side stays at nothing: out 0, lse -inf)."""
  both = jnp.logaddexp(lse, s)
  at = jnp.where(jnp.isneginf(both), 0.0, both)
  return out * jnp.exp(lse - at)[..., None] + o * jnp.exp(s - at)[..., None], both


def _pairs_bwd(axis, sp, zigzag, steps, blocks, res, do):
  q, k, v, seg, out, lse = res
  def fold(dq, blk, pairs, diagonal):
    kb, vb, segb, dk, dv = blk
    for qs, ks in pairs:
      gq, gk, gv = blocks.backward(q[:, qs], kb[:, ks], vb[:, ks], _rows(seg, qs), _rows(segb, ks), out[:, qs],
                                   do[:, qs], lse[:, qs], diagonal)
      dq, dk, dv = dq.at[:, qs].add(gq), dk.at[:, ks].add(gk), dv.at[:, ks].add(gv)
    return dq, (kb, vb, segb, dk, dv)
  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
  dq, (*_, dk, dv) = _steps(zeros(q), (k, v, seg, zeros(k), zeros(v)), fold, q.shape[1], axis, sp, zigzag, 0,
                            steps)
  if steps:
    dk, dv = jax.lax.ppermute((dk, dv), axis, [(i, (i - steps) % sp) for i in range(sp)])
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring_pairs.defvjp(_pairs_fwd, _pairs_bwd)


def _visible(nq: int, nk: int, seg_q, seg_k, causal: bool):
  """(b or 1, nq, 1, 1, nk): the pair's visible keys, as jaxtrain.model.flash takes them."""
  shown = jnp.asarray(np.tri(nq, nk, dtype=bool) if causal else np.ones((nq, nk), bool))[None]
  if seg_q is not None:
    shown = shown & (seg_q[:, :, None] == seg_k[:, None, :])
  return shown[:, :, None, None, :]


def _xla_forward(q, k, v, seg_q, seg_k, causal):
  b, n, H, E = q.shape
  K = k.shape[2]
  m, l, acc = flash.fold(flash.start((b, n, K, H // K), None, v.shape[-1]), q.reshape(b, n, K, H // K, E), k, v,
                         _visible(n, k.shape[1], seg_q, seg_k, causal))
  seen = l > 0  # a query whose segment has no key in the pair: out 0, lse -inf (the merge weighs it by zero)
  out = acc / jnp.where(seen, l, 1.0)[..., None]
  return out.reshape(b, n, H, -1), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf).reshape(b, n, H)


def _xla_backward(q, k, v, seg_q, seg_k, out, do, lse, causal):
  b, n, H, E = q.shape
  K = k.shape[2]
  split = lambda x: x.reshape(b, n, K, H // K, *x.shape[3:]).astype(jnp.float32)  # noqa: E731
  do5 = split(do)
  delta = jnp.sum(do5 * split(out), axis=-1)
  dq, dk, dv = flash.grad_block(q.reshape(b, n, K, H // K, E), k, v, do5, split(lse), delta,
                                _visible(n, k.shape[1], seg_q, seg_k, causal))
  return dq.reshape(q.shape), dk, dv


XLA = Blocks(_xla_forward, _xla_backward)  # the online softmax's math as a pair kernel: the reference of `CUDNN`
CUDNN = Blocks(kernels.block_forward, kernels.block_backward)


def pair_problem(model_cfg, seq_len: int | None, info) -> str | None:
  """Why ring attention's block pairs cannot call cuDNN, None where they can: cuDNN runs for this model on `info`
  (MLA's narrower v zero-padded, as one device's cuDNN call pads it), no layer has a window or sinks, the private
  module has what `kernels.block_module` needs, and on a local GPU its pairs agree with `XLA` (`check_cudnn`)."""
  m = model_cfg
  problem = (f"model.attention={m.attention}" if m.attention in ("xla", "blocked") else
             kernels.cudnn_problem(m, seq_len, info) or next((why for failed, why in (
                 (any(m.layer_windows()), "sliding windows"),
                 (kernels.block_module() is None, "jax's private cuDNN module lacks what the pairs use"))
                 if failed), None))
  if problem is None and jax.default_backend() == "gpu":
    problem = check_cudnn()
  return problem


def pair_words(problem: str | None, segments: int | None) -> str:
  """The plan line's account of the ring's pairs (`segments`: the most a row of the data holds, None: not known)."""
  if problem:
    return f"online softmax over XLA blocks, not cuDNN: {problem}"
  how = ("one document per row: causal on the diagonal, no mask off it" if segments == 1 else
         "a pair's segment mask as a bias: " + (f"rows hold up to {segments} documents" if segments else
                                                 "the documents a row holds are not known here"))
  return f"cuDNN fused attention on each block pair ({how})"


@functools.cache
def check_cudnn() -> str | None:
  """Once per process on a GPU: what the ring computes with cuDNN's pairs (`two_pairs`: forward, merge, backward
  with the merged statistics) against the same with `XLA`: rows of one document, packed rows, and MLA's narrower
  v. None where they agree; else why not."""
  rng = np.random.default_rng(0)
  make = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
  q, k, v, do = make(2, 128, 4, 64), make(2, 128, 2, 64), make(2, 128, 2, 64), make(2, 128, 4, 64)
  packed = jnp.asarray(np.repeat([[1, 2, 3, 3], [4, 4, 5, 6]], 32, axis=1), jnp.int32)  # documents end mid-half
  try:
    for case, seg, width in (("rows of one document", None, 64), ("packed rows", packed, 64), ("MLA's v", None, 32)):
      args = (q, k, v[..., :width], seg, do[..., :width])
      got, want = (jax.jit(functools.partial(two_pairs, kind))(*args) for kind in (CUDNN, XLA))
      for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-6))
        if not err < 0.02:
          return f"cuDNN's pairs differ from XLA's in {name} by {err:.3g} on {case}"
  except Exception as e:  # noqa: BLE001 (a kernel this GPU or jax refuses: the XLA blocks run)
    return f"cuDNN's pairs failed their check: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
  return None


def two_pairs(blocks: Blocks, q, k, v, seg, do):
  """What the ring computes for the second half of a row's queries, on one device: their pairs with the first half
  of the keys (off the diagonal, first, as a later device's queries meet them) and with the second (the diagonal),
  merged; each pair's backward from the merged output and log-sum-exp. (out, dq) of those queries, (dk, dv) of
  every key, float32 (`seg` None: one document a row)."""
  n = q.shape[1] // 2
  q2, do2, seg2 = q[:, n:], do[:, n:], _rows(seg, slice(n, None))
  halves = ((slice(0, n), False), (slice(n, None), True))
  out, lse = nothing_yet(*q2.shape[:3], v.shape[-1])
  for ks, diagonal in halves:
    out, lse = merge(out, lse, *blocks.forward(q2, k[:, ks], v[:, ks], seg2, _rows(seg, ks), diagonal))
  out = out.astype(q.dtype)
  grads = [blocks.backward(q2, k[:, ks], v[:, ks], seg2, _rows(seg, ks), out, do2, lse, diagonal)
           for ks, diagonal in halves]
  join = lambda i: jnp.concatenate([grads[0][i], grads[1][i]], axis=1)  # noqa: E731
  return out.astype(jnp.float32), grads[0][0] + grads[1][0], join(1), join(2)
