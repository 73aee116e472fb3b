"""Next-token cross-entropy from the final hidden states: a scan over chunks of each device's tokens that
computes the gradient as it goes (no (B, L, V) logits kept), vocabulary-parallel by the `act_vocab`
annotation alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtrain.model import ops


HEAD_AXES = ("embed", "vocab")  # the output projection (D, V) as stored


def nll_sum(h_BxLxD, w_DxV, targets_BxL, weights_BxL, chunk_tokens: int = 0, logits_dtype: str = "float32",
            gather: bool = True, grad_scale=1.0):
  """sum of weight * (logsumexp(logits) - logits[target]) in float32, in chunks of `chunk_tokens` per device
  (train.loss_chunk_tokens); 0 = the plain loss (the target logit a gather unless `gather=False`: a one-hot
  product). `logits_dtype`: model.head_logits_dtype. `grad_scale`: the factor the caller multiplies this sum
  by before differentiating (loss scale / tokens): the chunked loss forms its gradient already scaled, as the
  autodiff of the plain loss does, so a float16 head gradient is as finite as the plain one's. `chunk_tokens` -1:
  the installed plan's choice for its device (jaxtrain.parallel.plan.loss_chunk)."""
  weights_BxL = weights_BxL.astype(jnp.float32)
  if chunk_tokens < 0:
    chunk_tokens = ops.current().loss_chunk_tokens
  if chunk_tokens <= 0:
    return _plain(h_BxLxD, w_DxV, targets_BxL, weights_BxL, jnp.dtype(logits_dtype), gather)
  scale = jnp.asarray(grad_scale, jnp.float32)
  return _chunked(h_BxLxD, w_DxV, targets_BxL, weights_BxL, jnp.dtype(logits_dtype), chunk_tokens, scale)


def _plain(h_BxLxD, w_DxV, targets_BxL, weights_BxL, logits_dtype, gather):
  """The whole (B, L, V) float32 logits at once (the reference, and train.loss_chunk_tokens=0)."""
  logits_BxLxV = jnp.einsum("bld,dv->blv", h_BxLxD, ops.cast(w_DxV, HEAD_AXES, h_BxLxD.dtype),
                            preferred_element_type=logits_dtype).astype(jnp.float32)
  axes = ("batch", "length", "act_vocab")
  if not gather:
    return jnp.sum(_token_nll(logits_BxLxV, targets_BxL, axes) * weights_BxL)
  logits_BxLxV = ops.constrain(logits_BxLxV, axes)
  target_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
  return jnp.sum((jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_BxL) * weights_BxL)


def target_logp(h_BxLxD, w_DxV, targets_BxL, logits_dtype: str = "float32"):
  """log p(target) of every token in float32, from the whole (B, L, V) logits (DPO sums them per sequence; the
  chunked loss keeps only totals). The target logit by a one-hot product: no gather over the vocabulary's split."""
  logits_BxLxV = jnp.einsum("bld,dv->blv", h_BxLxD, ops.cast(w_DxV, HEAD_AXES, h_BxLxD.dtype),
                            preferred_element_type=jnp.dtype(logits_dtype)).astype(jnp.float32)
  return -_token_nll(logits_BxLxV, targets_BxL, ("batch", "length", "act_vocab"))


def _token_nll(logits, targets, axes):
  """logsumexp - target logit per token, the target logit as sum(logits * one_hot): no gather over the vocab split."""
  logits = ops.constrain(logits, axes)
  hot = ops.constrain(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axes)
  return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * hot, axis=-1)


def chunk_layout(B: int, L: int, chunk_tokens: int) -> tuple[int, int, int]:
  """(sw, n, c): length = sw (mesh split) x n chunks x c, c the largest divisor with local rows * c <= chunk_tokens
  (the split as ops says, i.e. the installed plan's)."""
  bw, sw = ops.current().ways(("batch", "length"), (B, L))
  c = chunk_length(max(B // bw, 1), L // sw, chunk_tokens)
  return sw, L // sw // c, c


def chunk_length(rows: int, length: int, chunk_tokens: int) -> int:
  """The positions a chunk of a device's `rows` x `length` tokens spans: the largest divisor of `length` with
  rows x it <= chunk_tokens (at least 1)."""
  want = max(1, chunk_tokens // rows)
  return max(d for d in range(1, min(want, length) + 1) if length % d == 0)


H_AXES = ("batch", "length", "act_embed")  # the head is a tensor-parallel region: hidden states whole on `tensor`
CHUNK_AXES = ("batch", None, "length", None, "act_vocab")  # a chunk's (G, B/G, S, c, V) logits


def _chunked(h_BxLxD, w_DxV, targets_BxL, weights_BxL, ld, chunk_tokens, scale):
  """The gradient is computed in the forward pass, chunk by chunk (a fused linear cross-entropy): the
  bf16 weight is gathered once, its gradient summed per device over the chunks and reduce-scattered
  once, and no logits are recomputed; the backward pass only rescales the saved gradients."""
  B, L, _ = h_BxLxD.shape
  G, S = ops.current().ways(("batch", "length"), (B, L))
  _, n, c = chunk_layout(B, L, chunk_tokens)
  h_BxLxD = ops.constrain(h_BxLxD, H_AXES)

  def split(x_BxL_):
    """(B, L, ...) -> (n, G, B/G, S, c, ...): chunk i is positions i*c .. i*c+c-1 of each device's slice;
    G and S are the mesh's batch and length splits, so per-device sums stay per device."""
    rest = x_BxL_.shape[2:]
    x = jnp.moveaxis(x_BxL_.reshape(G, B // G, S, n, c, *rest), 3, 0)
    return ops.constrain(x, (None, "batch", None, "length", None, *(("act_embed",) if rest else ())))

  def run(h_BxLxD, w_DxV, targets_BxL, weights_BxL, scale, grad: bool):
    # gathered here, once, to the layout the chunks use (whole over fsdp, split over tensor like the logits)
    w16_DxV = ops.constrain(ops.cast(w_DxV, HEAD_AXES, h_BxLxD.dtype), (None, "act_vocab"))
    dw0 = ops.constrain(jnp.zeros((G, S) + w_DxV.shape if grad else (), jnp.float32),
                        ("batch", "length", None, "act_vocab") if grad else ())
    xs = (split(h_BxLxD), split(targets_BxL), split(weights_BxL))
    step = functools.partial(_chunk, w16_DxV=w16_DxV, ld=ld, scale=scale, grad=grad)
    (total, dw_GxSxDxV), dh = jax.lax.scan(step, (jnp.float32(0), dw0), xs)
    if not grad:
      return total
    dh_BxLxD = ops.constrain(jnp.moveaxis(dh, 0, 3).reshape(h_BxLxD.shape), H_AXES)
    # the one reduction over the devices' tokens: a reduce-scatter to the weight's own layout, in the compute
    # dtype like every layer weight's gradient (jnp.sum would sum bfloat16 in float32). reduce_sum, not lax.reduce
    # with a traced zero: that lowers its add through jax, which inside a partly manual shard_map (the pipeline)
    # wraps it in a sharding constraint, so the collective's reducer ends in a copy and XLA:CPU's
    # all-reduce-promotion (bf16 -> f32) aborts: "Invalid binary instruction opcode copy"
    dw16 = dw_GxSxDxV.astype(h_BxLxD.dtype)
    dw_DxV = ops.constrain(jax.lax.reduce_sum(dw16, (0, 1)), HEAD_AXES)
    return total, (dh_BxLxD, dw_DxV, scale)

  # every array an argument: a custom_vjp must not close over traced values (it breaks inside the pipeline)
  @jax.custom_vjp
  def loss(h_BxLxD, w_DxV, targets_BxL, weights_BxL, scale):
    return run(h_BxLxD, w_DxV, targets_BxL, weights_BxL, scale, grad=False)

  def fwd(h_BxLxD, w_DxV, targets_BxL, weights_BxL, scale):
    return run(h_BxLxD, w_DxV, targets_BxL, weights_BxL, scale, grad=True)

  def bwd(res, g):
    dh_BxLxD, dw_DxV, scale = res
    unscale = g / scale  # 1 exactly when the caller's factor is `scale`
    return ((unscale * dh_BxLxD).astype(h_BxLxD.dtype), (unscale * dw_DxV.astype(jnp.float32)).astype(w_DxV.dtype),
            None, None, None)

  loss.defvjp(fwd, bwd)
  return loss(h_BxLxD, w_DxV, targets_BxL, weights_BxL, scale)


def _chunk(carry, xs, *, w16_DxV, ld, scale, grad: bool):
  """One chunk of the scan: (running loss sum, running per-device weight gradient) and this chunk's d(loss)/d(h)."""
  total, dw_GxSxDxV = carry
  h_GxBxSxCxD, t_GxBxSxC, wt_GxBxSxC = xs
  logits = ops.constrain(jnp.einsum("gbscd,dv->gbscv", h_GxBxSxCxD, w16_DxV,
                                    preferred_element_type=ld).astype(jnp.float32), CHUNK_AXES)
  hot = ops.constrain(jax.nn.one_hot(t_GxBxSxC, w16_DxV.shape[1], dtype=jnp.float32), CHUNK_AXES)
  # logsumexp as jax.nn.logsumexp computes it, and below its gradient in the order autodiff has it
  top = jnp.max(logits, axis=-1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0)
  exp = jnp.exp(logits - top)
  sumexp = jnp.sum(exp, axis=-1)
  lse = jnp.log(sumexp) + top[..., 0]
  total = total + jnp.sum((lse - jnp.sum(logits * hot, axis=-1)) * wt_GxBxSxC)
  if not grad:
    return (total, dw_GxSxDxV), None
  # d(scale * loss)/d(logits), into both products in the logits' dtype as the autodiff of the plain loss has
  # it: scaled before the cast, so that a float16 gradient is finite where the plain loss's is
  dlogits = ((exp * (wt_GxBxSxC / sumexp)[..., None] - hot * wt_GxBxSxC[..., None]) * scale).astype(ld)
  dh = jax.lax.dot_general(dlogits, w16_DxV, (((4,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  dw = jax.lax.dot_general(h_GxBxSxCxD, dlogits, (((1, 3), (1, 3)), ((0, 2), (0, 2))),
                           preferred_element_type=jnp.float32)
  return (total, dw_GxSxDxV + dw), dh


def temp_bytes(vocab: int, d_model: int, batch: int, seq: int, chunk_tokens: int, dtype: str = "bfloat16",
               device=None) -> int:
  """XLA's temporary bytes of the compiled loss + gradient on one `device` (default: local backend)."""
  from jax.sharding import SingleDeviceSharding
  sh = SingleDeviceSharding(device) if device is not None else None
  arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  f = jax.value_and_grad(lambda h, w, t, m: nll_sum(h, w, t, m, chunk_tokens), argnums=(0, 1))
  lowered = jax.jit(f).lower(arg((batch, seq, d_model), jnp.dtype(dtype)), arg((d_model, vocab), jnp.float32),
                             arg((batch, seq), jnp.int32), arg((batch, seq), jnp.int32))
  return lowered.compile().memory_analysis().temp_size_in_bytes
