"""Adam's moments (and Muon's momentum) stored below float32 (optim.state_dtype, docs/training.md#state-dtype): the
update decodes them to float32, runs the float32 math, and encodes the new values; the master stays float32.

bfloat16: a cast (round to nearest). int8: bitsandbytes' 8-bit Adam scheme (Dettmers et al. 2022), block-wise
dynamic quantization: each block of BLOCK values along a parameter's last axis keeps its absmax (float32) and each
value the index (uint8) of the nearest of 256 code points to value / absmax. The code is the dynamic (tree) code:
each decade 10^-e (e = 0..6) has its own linearly spaced points, finer near zero, so a value far below its block's
absmax keeps its leading digits. The first moment uses the signed code, the second moment (never negative) the
unsigned one, whose 8th bit is spent on precision instead of a sign. Blocks run along the last axis so that codes
shard exactly as the parameter does and scales as its blocks do (`scale_sharding`). A parameter of fewer than
MIN_QUANTIZED values keeps float32 moments (norms, biases: bitsandbytes' rule too; their bytes do not matter)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

BLOCK = 256  # values per scale (bitsandbytes' 8-bit optimizers use 256)
MIN_QUANTIZED = 4096  # smaller parameters keep float32 moments


class Quantized(NamedTuple):
  codes: jax.Array  # uint8 indices into the code, shaped like the parameter
  scales: jax.Array  # float32 absmax of each block: shape[:-1] + (blocks,), blocks = ceil(last / block)


@functools.cache
def dynamic_code(signed: bool) -> np.ndarray:
  """The 256 sorted points of the dynamic code on [-1, 1] (signed) or [0, 1]: decade e (e = 0..6) holds
  2^(k-1-e) points 10^-e (0.1 + 0.9 (j + 1/2) / 2^(k-1-e)), k = 7 value bits signed (one bit is the sign), 8
  unsigned; then 0 and 1 (and the negatives of the decades, signed)."""
  bits = 7 if signed else 8
  pos = [10.0 ** -e * (0.1 + 0.9 * (j + 0.5) / 2 ** (bits - 1 - e)) for e in range(7)
         for j in range(2 ** (bits - 1 - e))]
  points = pos + [0.0, 1.0] + ([-p for p in pos] if signed else [])
  assert len(points) == 256
  return np.sort(np.asarray(points, np.float32))


def block_of(n: int) -> int:
  return min(BLOCK, n)


def _blocks(x, n: int):
  """x (..., n) padded with zeros and seen as (..., blocks, block)."""
  b = block_of(n)
  nb = -(-n // b)
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * b - n)]) if nb * b != n else x
  return x.reshape(*x.shape[:-1], nb, b)


def quantize(x, signed: bool) -> Quantized:
  """x (float32, at least 1-D) as codes of the nearest code point to x / its block's absmax, and the absmaxes."""
  n = x.shape[-1]
  xb = _blocks(x.astype(jnp.float32), n)
  absmax = jnp.max(jnp.abs(xb), axis=-1)
  code = dynamic_code(signed)
  mid = jnp.asarray((code[1:] + code[:-1]) / 2)  # the nearest point: the number of midpoints below
  normed = xb / jnp.where(absmax > 0, absmax, 1.0)[..., None]
  # a binary search (8 gathers an element): comparing against all 255 midpoints cost 6x its time on CPU
  idx = jnp.searchsorted(mid, normed, method="scan_unrolled")
  codes = idx.astype(jnp.uint8).reshape(*x.shape[:-1], -1)[..., :n]
  return Quantized(codes, absmax)


def dequantize(q: Quantized, signed: bool):
  n = q.codes.shape[-1]
  values = jnp.asarray(dynamic_code(signed))[_blocks(q.codes, n).astype(jnp.int32)] * q.scales[..., None]
  return values.reshape(*q.codes.shape[:-1], -1)[..., :n]


class Store:
  """How optim.state_dtype keeps one kind of moment: `zeros(p)` its initial value for parameter p, `load(s)` it as
  float32, `save(x, like)` a new float32 value kept as `like` (the old value) is. `signed`: the first moment."""

  def __init__(self, dtype: str, signed: bool):
    self.dtype, self.signed = dtype, signed

  def zeros(self, p):
    if self.dtype == "int8" and p.size >= MIN_QUANTIZED and p.ndim:
      return Quantized(jnp.zeros(p.shape, jnp.uint8),
                       jnp.zeros((*p.shape[:-1], -(-p.shape[-1] // block_of(p.shape[-1]))), jnp.float32))
    return jnp.zeros(p.shape, jnp.bfloat16 if self.dtype == "bfloat16" else jnp.float32)

  def load(self, s):
    return dequantize(s, self.signed) if isinstance(s, Quantized) else s.astype(jnp.float32)

  def save(self, x, like):
    return quantize(x, self.signed) if isinstance(like, Quantized) else x.astype(like.dtype)

  def tree(self, f, *trees):
    return jax.tree.map(f, *trees, is_leaf=lambda s: isinstance(s, Quantized))


def ratio_bound(b1: float, b2: float, t) -> jax.Array | None:
  """The most |m_hat / (sqrt(v_hat) + eps)| can be at Adam's t-th update (t >= 1), whatever the gradients were,
  for moments that started at zero with these betas: by Cauchy-Schwarz, |m_t| <= (1-b1) sqrt(S_t v_t / (1-b2)) with
  S_t = sum_{k<t} (b1^2/b2)^k, and the bias corrections. 1 at t = 1. None where b1^2 >= b2 (S_t grows without
  bound)."""
  if b2 == 0:  # v = g^2: |m/sqrt(v)| <= 1 where m = g (b1 = 0), unbounded otherwise
    return jnp.float32(1.0) if b1 == 0 else None
  r = b1 ** 2 / b2
  if r >= 1:
    return None
  t = jnp.asarray(t, jnp.float32)
  s = (1 - r ** t) / (1 - r)
  return (1 - b1) / (1 - b1 ** t) * jnp.sqrt((1 - b2 ** t) / (1 - b2) * s)


class StoredAdamState(NamedTuple):
  count: jax.Array  # int32 updates made
  mu: optax.Updates  # first moments, each as `Store` keeps it
  nu: optax.Updates  # second moments


def scale_by_adam(b1: float, b2: float, eps: float, dtype: str) -> optax.GradientTransformation:
  """optax.scale_by_adam (bias-corrected m / (sqrt(v) + eps)) on moments kept as `Store(dtype)` keeps them: the same
  float32 arithmetic on the decoded moments, then the new moments encoded."""
  first, second = Store(dtype, True), Store(dtype, False)

  def init(params):
    return StoredAdamState(jnp.zeros([], jnp.int32), jax.tree.map(first.zeros, params),
                           jax.tree.map(second.zeros, params))

  def update(g, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    m = first.tree(lambda s, x: b1 * first.load(s) + (1 - b1) * x, state.mu, g)
    v = second.tree(lambda s, x: b2 * second.load(s) + (1 - b2) * jnp.square(x), state.nu, g)
    c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
    u = jax.tree.map(lambda a, b: (a / c1) / (jnp.sqrt(b / c2) + eps), m, v)
    # exact moments never exceed the bound; a stored v rounded to 0 under a nonzero m (a token absent since) would
    # give m / eps: the clip keeps the rounding from moving a parameter further than float32 Adam ever could
    if (bound := ratio_bound(b1, b2, count)) is not None:
      u = jax.tree.map(lambda x: jnp.clip(x, -bound, bound), u)
    return u, StoredAdamState(count, first.tree(lambda s, x: first.save(x, s), state.mu, m),
                              second.tree(lambda s, x: second.save(x, s), state.nu, v))
  return optax.GradientTransformation(init, update)


def scale_sharding(sh: NamedSharding, shape) -> NamedSharding:
  """The scales' sharding for codes sharded as `sh` (the parameter's): the same, where each shard of the last axis
  is whole blocks; else that axis replicated (the scales are 1/BLOCK of the values)."""
  spec = tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec))
  n, last = shape[-1], spec[-1]
  ways = math.prod(sh.mesh.shape[a] for a in ((last,) if isinstance(last, str) else last or ()))
  if ways > 1 and (n % ways or (n // ways) % block_of(n)):
    spec = spec[:-1] + (None,)
  return NamedSharding(sh.mesh, P(*spec), memory_kind=sh.memory_kind)


def sharding_like(x, sh):
  """A moment's sharding from its parameter's `sh`: codes like the parameter, scales by `scale_sharding`."""
  return Quantized(sh, scale_sharding(sh, x.codes.shape)) if isinstance(x, Quantized) else sh
