"""Next-token cross-entropy from the final hidden states: a scan over chunks of each device's tokens under
jax.checkpoint (no (B, L, V) logits kept), vocabulary-parallel by the `act_vocab` annotation alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.parallel import sharding


def nll_sum(h_BxLxD, w_DxV, targets_BxL, weights_BxL, plan, chunk_tokens: int, gather: bool = True):
  """sum of weight * (logsumexp(logits) - logits[target]) in float32, in chunks of `chunk_tokens` per device;
  0 = the plain loss (the target logit a gather unless `gather=False`: a one-hot product)."""
  weights_BxL = weights_BxL.astype(jnp.float32)
  if chunk_tokens <= 0:
    return _plain(h_BxLxD, w_DxV, targets_BxL, weights_BxL, plan, gather)
  return _chunked(h_BxLxD, w_DxV, targets_BxL, weights_BxL, plan, chunk_tokens)


def _plain(h_BxLxD, w_DxV, targets_BxL, weights_BxL, plan, gather):
  """The whole (B, L, V) float32 logits at once (the reference, and train.loss_chunk_tokens=0)."""
  logits_BxLxV = jnp.einsum("bld,dv->blv", h_BxLxD, w_DxV.astype(h_BxLxD.dtype), preferred_element_type=jnp.float32)
  axes = ("batch", "length", "act_vocab")
  if not gather:
    return jnp.sum(_token_nll(logits_BxLxV, targets_BxL, axes, plan) * weights_BxL)
  logits_BxLxV = plan.constrain(logits_BxLxV, axes)
  target_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
  return jnp.sum((jax.nn.logsumexp(logits_BxLxV, axis=-1) - target_BxL) * weights_BxL)


def _token_nll(logits, targets, axes, plan):
  """logsumexp - target logit per token, the target logit as sum(logits * one_hot): no gather over the vocab split."""
  logits = plan.constrain(logits, axes)
  hot = plan.constrain(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axes)
  return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * hot, axis=-1)


def chunk_layout(B: int, L: int, plan, chunk_tokens: int) -> tuple[int, int, int]:
  """(sw, n, c): length = sw (mesh split) x n chunks x c, c the largest divisor with local rows * c <= chunk_tokens."""
  spec = plan.spec(("batch", "length"), (B, L)) if plan.mesh is not None else (None, None)
  bw, sw = sharding.ways(spec[0], plan.mesh), sharding.ways(spec[1], plan.mesh)
  local_len = L // sw
  want = max(1, chunk_tokens // max(B // bw, 1))
  c = max(d for d in range(1, min(want, local_len) + 1) if local_len % d == 0)
  return sw, local_len // c, c


def _chunked(h_BxLxD, w_DxV, targets_BxL, weights_BxL, plan, chunk_tokens):
  B, L, _ = h_BxLxD.shape
  sw, n, c = chunk_layout(B, L, plan, chunk_tokens)
  # the head is a tensor-parallel region: it takes the hidden states whole along `tensor`
  h_BxLxD = plan.constrain(h_BxLxD, ("batch", "length", "act_embed"))

  def split(x_BxL_):
    """(B, L, ...) -> (n, B, sw, c, ...): chunk i is positions i*c .. i*c+c-1 of each device's slice."""
    rest = x_BxL_.shape[2:]
    x = jnp.moveaxis(x_BxL_.reshape(B, sw, n, c, *rest), 2, 0)
    return plan.constrain(x, (None, "batch", "length", None, *(("act_embed",) if rest else ())))

  def chunk_nll(total, xs):
    h_BxSxCxD, t_BxSxC, wt_BxSxC = xs
    logits = jnp.einsum("bscd,dv->bscv", h_BxSxCxD, w_DxV.astype(h_BxSxCxD.dtype), preferred_element_type=jnp.float32)
    nll = _token_nll(logits, t_BxSxC, ("batch", "length", None, "act_vocab"), plan)
    return total + jnp.sum(nll * wt_BxSxC), None

  # nothing of a chunk is kept for the backward pass: it recomputes that chunk's logits
  body = jax.checkpoint(chunk_nll, prevent_cse=False, policy=jax.checkpoint_policies.nothing_saveable)
  total, _ = jax.lax.scan(body, jnp.float32(0), (split(h_BxLxD), split(targets_BxL), split(weights_BxL)))
  return total


def temp_bytes(vocab: int, d_model: int, batch: int, seq: int, chunk_tokens: int, dtype: str = "bfloat16",
               device=None) -> int:
  """XLA's temporary bytes of the compiled loss + gradient on one `device` (default: local backend)."""
  from jax.sharding import SingleDeviceSharding
  from jaxtrain.parallel import plan as plan_lib
  sh = SingleDeviceSharding(device) if device is not None else None
  arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  plan = plan_lib.local()
  f = jax.value_and_grad(lambda h, w, t, m: nll_sum(h, w, t, m, plan, chunk_tokens), argnums=(0, 1))
  lowered = jax.jit(f).lower(arg((batch, seq, d_model), jnp.dtype(dtype)), arg((d_model, vocab), jnp.float32),
                             arg((batch, seq), jnp.int32), arg((batch, seq), jnp.int32))
  return lowered.compile().memory_analysis().temp_size_in_bytes
