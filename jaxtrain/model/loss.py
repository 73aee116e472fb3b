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

Peak memory of the loss per device, for the memory bill (Tc = a chunk's local tokens =
rows * c, T = the microbatch's local tokens, Vt = V / tensor ways, D = d_model (the
output weight is gathered over fsdp for the head, as every FSDP weight), s = bytes of the
compute dtype). Kept from the forward to the backward pass: nothing of the logits (the
plain loss keeps T * Vt * 4, the exp of its logits). Temporaries, as XLA compiles them:
  XLA:GPU (H100):  s * D * Vt          (the compute-dtype copy of the output weight)
                 + 4 * Tc * Vt         (one chunk's f32 logits: the compiled temporaries grow
                                        by about 1x this per chunk size, 512 to 4096 tokens)
                 + under s * T * D     (20 MiB at the sizes below)
  XLA:CPU adds 2 * 4 * D * Vt (absent from the XLA:GPU compile): an f32 upcast of that
  copy for the hidden-state gradient (the plain loss has it too) and one chunk's f32
  weight gradient before it is added to the accumulator; and about 2x the chunk's
  logits at 4096 tokens.
The weight gradient itself (4 * D * Vt, f32) is the output. Measured at V = 128256,
D = 4096, T = 8192 (README, "Chunked cross-entropy"): XLA:GPU 7.83 GiB unchunked -> 1.48 GiB
at Tc = 1024; XLA:CPU 9.91 -> 5.54 GiB.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from jaxtrain.parallel import sharding


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
  return sharding.ways(spec[0], plan.mesh), sharding.ways(spec[1], plan.mesh)


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


def temp_bytes(vocab: int, d_model: int, batch: int, seq: int, chunk_tokens: int, dtype: str = "bfloat16",
               device=None) -> int:
  """XLA's temporary bytes of the compiled loss + gradient (w.r.t. the hidden states and the
  float32 output weight) on one device, compiled only: the figure README quotes. `device`:
  where to compile (default: the local backend; e.g. a compile-only H100 from
  `gpu_compile.devices`)."""
  from jax.sharding import SingleDeviceSharding
  from jaxtrain.parallel import plan as plan_lib
  sh = SingleDeviceSharding(device) if device is not None else None
  arg = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  plan = plan_lib.local()
  f = jax.value_and_grad(lambda h, w, t, m: nll_sum(h, w, t, m, plan, chunk_tokens), argnums=(0, 1))
  lowered = jax.jit(f).lower(arg((batch, seq, d_model), jnp.dtype(dtype)), arg((d_model, vocab), jnp.float32),
                             arg((batch, seq), jnp.int32), arg((batch, seq), jnp.int32))
  return lowered.compile().memory_analysis().temp_size_in_bytes
