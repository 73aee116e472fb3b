"""Next-token cross-entropy from the final hidden states, in chunks of tokens, vocabulary-parallel.

The plain loss builds the (B, L, V) float32 logits and keeps their exp for the backward
pass: for a 128k vocabulary at seq 8192 that is 4 GiB per sequence. `nll_sum` instead
runs a `lax.scan` over chunks of each device's tokens; the chunk body (logits = h @ W,
logsumexp, target logit, weighted sum) is under `jax.checkpoint`, so the forward pass
keeps nothing of a chunk and the backward pass recomputes one chunk's logits at a time.

Vocabulary parallelism is sharding only: a chunk's logits are annotated `act_vocab`
(split over `tensor` by the rules table, like the output weight's `vocab`), so XLA
computes each shard's max and sum-exp and all-reduces them across `tensor` (Megatron's
vocab-parallel loss); the target logit is a one-hot product (see `_token_nll`).

Chunking never splits a device's tokens across devices: the length axis L is cut as
(sequence ways, chunks, c) with only the first split over the mesh, and a chunk holds
every local row (B / batch ways) times c positions. c is the largest divisor of the
local length with rows * c <= train.loss_chunk_tokens (at least 1 position).

Peak memory of the loss per device (T = local tokens of the microbatch, Tc = rows * c
the chunk's tokens, Vt = V / tensor ways, s = bytes of the compute dtype, D = d_model):
  chunked:  about 3 * Tc * Vt * 4     (a chunk's f32 logits, their exp / softmax, the
                                       logits gradient; one chunk at a time)
          + D * Vt * 4                (f32 accumulator of the output weight's gradient)
          + T * D * (s + 4)           (the hidden states re-laid out in chunks and their
                                       gradient)
  plain (loss_chunk_tokens = 0): the same with Tc = T, plus T * Vt * 4 kept from the
  forward to the backward pass (the exp of the logits).
The compiled figures are in README ("Chunked cross-entropy").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def nll_sum(h_BxLxD, w_DxV, targets_BxL, weights_BxL, plan, chunk_tokens: int, gather: bool = True):
  """sum over tokens of weight * (logsumexp(logits) - logits[target]), logits = h @ w in float32.

  `h_BxLxD`: final-normed hidden states, compute dtype; `w_DxV`: the output weight (cast
  to h's dtype here, as the plain head does); `chunk_tokens`: tokens per chunk per device,
  0 = the plain unchunked loss, whose target logit is a gather unless `gather=False` (the
  pipeline's partial-manual region; a one-hot product there, which costs one more (B, L, V))."""
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
  """logsumexp - target logit per token, vocabulary last. The target logit is
  sum(logits * one_hot): exact, and a reduction over a vocab-split axis, where a gather
  would all-gather the logits (and abort XLA's partitioner inside the pipeline's
  partial-manual region)."""
  logits = plan.constrain(logits, axes)
  hot = plan.constrain(jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), axes)
  return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * hot, axis=-1)


def ways(plan, shape) -> tuple[int, int]:
  """(batch ways, length ways): how many devices split B and L of a (B, L) activation."""
  if plan.mesh is None:
    return 1, 1
  spec = plan.spec(("batch", "length"), shape)
  n = lambda e: 1 if e is None else math.prod(plan.mesh.shape[a] for a in (e if isinstance(e, tuple) else (e,)))  # noqa: E731
  return n(spec[0]), n(spec[1])


def chunk_layout(B: int, L: int, plan, chunk_tokens: int) -> tuple[int, int, int]:
  """(sw, n, c): the length axis as sw (split over the mesh) x n chunks x c positions."""
  bw, sw = ways(plan, (B, L))
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
    """(B, L, ...) -> (n, B, sw, c, ...): chunk i holds positions i*c .. i*c+c-1 of every
    device's slice of L."""
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
