"""FP8 projection matmuls (model.fp8): current per-tensor scaling in XLA's quantize-dequantize form.

`matmul(mode, fn, x, w, ...)` runs the bilinear `fn` (an einsum, @, ragged_dot) on x and w sent through
e4m3 and back, and sends the output's gradient through e5m2 in the backward; autodiff of `fn` then gives
both backward matmuls (dgrad, wgrad) dequantized-FP8 operands too. XLA:GPU's gemm rewriter turns a dot
of `convert(f8) * scale` operands into a cuBLASLt FP8 GEMM; elsewhere (CPU) the same casts are emulated.
flax.linen.fp8_ops gives the quantize-dequantize; its custom_vjps carry delayed-scaling state, so the two
straight-through ones for current scaling are here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# A pipeline stage's layers are their own tensors, and its branches differ across stages: no pmax over it.
NOT_GLOBAL = ("pipeline",)


def scale(x, dtype):
  """The power-of-two scale s with max|x| / s <= the format's max (1 for an all-zero x): a power of two,
  so s is exact in any compute dtype and a loss scale passes through the cast unchanged. max|x| is the
  global amax: jnp.max under GSPMD, plus a pmax over the manual axes inside a shard_map."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  manual = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes if a not in NOT_GLOBAL)
  amax = jax.lax.pmax(amax, manual) if manual else amax
  _, e = jnp.frexp(amax / float(jnp.finfo(dtype).max))  # amax / max < 2^e
  s = jnp.ldexp(jnp.float32(1), e)
  # an infinite amax stays the scale (the cast then gives nan): a float16 run's overflow check still sees it
  return jnp.where(amax > 0, jnp.where(jnp.isfinite(amax), s, amax), 1.0)


def qdq(x, dtype):
  """x through `dtype` (e4m3 or e5m2) with its scale, back in x's dtype."""
  return fp8_ops.qdq(x, dtype, jax.lax.stop_gradient(scale(x, dtype)), jnp.float32)


@jax.custom_vjp
def _in(x):
  return qdq(x, E4M3)


_in.defvjp(lambda x: (qdq(x, E4M3), None), lambda _, g: (g,))  # straight through: the gradient as it comes


@jax.custom_vjp
def _grad_out(y):
  return y


_grad_out.defvjp(lambda y: (y, None), lambda _, g: (qdq(g, E5M2),))


def matmul(mode: str, fn, x, w, *args, **kw):
  """fn(x, w, *args, **kw), with mode `tensorwise` in FP8 as the module says; `none`: as is."""
  if mode == "none":
    return fn(x, w, *args, **kw)
  return _grad_out(fn(_in(x), _in(w), *args, **kw))


def einsum(mode: str, spec: str, x, w):
  return matmul(mode, lambda a, b: jnp.einsum(spec, a, b), x, w)
