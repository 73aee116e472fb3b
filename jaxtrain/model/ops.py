"""How the model's math runs on devices, decided outside the model. The model calls the functions below; the step
installs an `Ops` (the execution plan of jaxtrain.parallel.plan) around its trace with `use`. With none installed
they are the one-device reference: no annotations, the reference attention, every projection a plain einsum, the
experts on one device. This is how parallelism reaches a plain model: sharding constraints at block boundaries, the
attention kernel, the MoE dispatch and the FP8 projections are all an `Ops` method."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from jaxtrain.model import attention, moe_kernels, quant


LOSS_CHUNK_TOKENS = 1024  # train.loss_chunk_tokens=-1 (automatic) where the plan knows no better (parallel.plan)


class Ops:
  """The one-device reference; a plan overrides what its mesh and device need."""

  loss_chunk_tokens: int = LOSS_CHUNK_TOKENS  # what train.loss_chunk_tokens=-1 runs (jaxtrain.model.loss)

  def constrain(self, x: jax.Array, axes) -> jax.Array:
    """`x` annotated with logical axes (names of the rules table; None = replicated)."""
    return x

  def ways(self, axes, shape) -> tuple[int, ...]:
    """How many devices split each dimension of an array with these logical axes."""
    return (1,) * len(shape)

  def lookup(self, table_VxD, tokens_BxL):
    """The rows of `table` at `tokens` (an embedding lookup)."""
    return jnp.take(table_VxD, tokens_BxL, axis=0)

  def batch_mean(self, x_mean):
    """The microbatch's mean of a statistic, from the mean over the rows this device computes: the same on one
    device (a data-parallel region, where each device sees only its rows, makes it the whole microbatch's)."""
    return x_mean

  def attend(self, q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, logits_dtype: str = "float32", window: int = 0,
             sinks_H=None):
    """Causal grouped-query attention within segments; `logits_dtype`: the reference kernel's scores; `window`
    (static): a local layer's sliding window (0: none); `sinks_H`: attention sinks' logits, or None."""
    return attention.attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, jnp.dtype(logits_dtype), window, sinks_H)

  def dequantize(self, q, axes, dtype):
    """QLoRA's weight `q` (a quant.QTensor whose weight has logical `axes`, leading stack axes included) in `dtype`,
    as the layer's matmuls use it."""
    return quant.dequantize(q, dtype)

  def cast(self, w, axes, dtype):
    """A weight (logical `axes`) in the compute `dtype` for its use."""
    return w.astype(dtype)

  def project(self, fn, x, w, *args):
    """A projection: the bilinear `fn(x, w, *args)` (einsum, ragged_dot). The FP8 policy replaces it."""
    return fn(x, w, *args)

  def experts(self, x_BxLxD, idx_BxLxk, w_BxLxk, weights, group: int, capacity: int | None, act=None):
    """(y (B, L, D) float32, dropped assignments) of the routed experts; `capacity` None: dropless, else slots
    per expert in each group of `group` consecutive positions. `weights`: moe_kernels.biases'; `act`: glu's."""
    if capacity is None:
      return moe_kernels.grouped_ffn_BxL(x_BxLxD, idx_BxLxk, w_BxLxk, weights, "ragged_dot", act=act), jnp.float32(0)
    return moe_kernels.capacity_ffn(x_BxLxD, idx_BxLxk, w_BxLxk, weights, group, capacity, act=act)


_CURRENT: contextvars.ContextVar[Ops] = contextvars.ContextVar("jaxtrain_ops", default=Ops())


def current() -> Ops:
  return _CURRENT.get()


@contextlib.contextmanager
def use(ops: Ops):
  """Runs the model's math as `ops` says while the block traces (installed by the step, the pipeline's region,
  decoding)."""
  token = _CURRENT.set(ops)
  try:
    yield ops
  finally:
    _CURRENT.reset(token)


def dequantize(q, axes, dtype):
  return current().dequantize(q, axes, dtype)


def constrain(x, axes):
  return current().constrain(x, axes)


def batch_mean(x_mean):
  return current().batch_mean(x_mean)


def lookup(table_VxD, tokens_BxL):
  return current().lookup(table_VxD, tokens_BxL)


def cast(w, axes, dtype):
  return current().cast(w, axes, dtype)


def weight(var, dtype):
  """A module's weight variable in the compute `dtype`, for a projection (its logical axes from the variable; a
  scanned stack's per-layer slice has the stack's `layers` axis no more)."""
  w, axes = var[...], var.get_metadata().get("axes")
  return cast(w, tuple(axes)[len(axes) - w.ndim:] if axes else None, dtype)


def einsum(spec: str, x, w):
  """A projection written as an einsum (activation first, weight second)."""
  return current().project(lambda a, b: jnp.einsum(spec, a, b), x, w)


def matmul(x, w):
  return current().project(jnp.matmul, x, w)
