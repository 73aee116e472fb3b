"""The reference attention kernels, plain math: causal grouped-query attention within segments (training), and
over a KV cache (decoding). Which kernel a run uses is the execution plan's choice (jaxtrain.parallel.kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a fully masked row (padding) gives no NaN


def attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, logits_dtype=jnp.float32):
  """Causal grouped-query attention; a token sees only earlier tokens of its own segment.
  Scores and softmax in `logits_dtype` (model.attention_logits_dtype)."""
  L = q_BxLxHxE.shape[1]
  causal_LxL = jnp.tril(jnp.ones((L, L), bool))
  same_BxLxL = seg_BxL[:, :, None] == seg_BxL[:, None, :]
  return masked_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, causal_LxL & same_BxLxL, logits_dtype)


def max_logit(q_BxLxHxE, k_BxLxKxE, seg_BxL):
  """Each head's largest attention logit q.k / sqrt(E) (H,), float32, over the pairs `attention` lets attend
  (causal, within a segment): what QK-clip (optim.qk_clip) bounds. From q and k themselves, whatever kernel the
  attention runs (a fused one, cuDNN's, does not return its scores); one layer's float32 score block at a time."""
  B, L, H, E = q_BxLxHxE.shape
  K = k_BxLxKxE.shape[2]
  q_BxLxKxGxE = q_BxLxHxE.reshape(B, L, K, H // K, E)
  s_BxKxGxLxL = jnp.einsum("blkge,bmke->bkglm", q_BxLxKxGxE, k_BxLxKxE,
                           preferred_element_type=jnp.float32) * jnp.float32(E**-0.5)
  allowed_BxLxL = jnp.tril(jnp.ones((L, L), bool)) & (seg_BxL[:, :, None] == seg_BxL[:, None, :])
  s_BxKxGxLxL = jnp.where(allowed_BxLxL[:, None, None], s_BxKxGxLxL, NEG_INF)
  return jnp.max(s_BxKxGxLxL, axis=(0, 3, 4)).reshape(H)  # every row sees its own token: never NEG_INF


def masked_attention(q_BxLxHxE, k_BxMxKxE, v_BxMxKxE, mask_BxLxM, logits_dtype=jnp.float32):
  """GQA of L queries over M keys where `mask_BxLxM` allows (M = L in training, the
  cache length when decoding)."""
  B, L, H, E = q_BxLxHxE.shape
  K = k_BxMxKxE.shape[2]
  q_BxLxKxGxE = q_BxLxHxE.reshape(B, L, K, H // K, E)
  s_BxKxGxLxM = jnp.einsum("blkge,bmke->bkglm", q_BxLxKxGxE, k_BxMxKxE,
                           preferred_element_type=logits_dtype) * jnp.asarray(E**-0.5, logits_dtype)
  s_BxKxGxLxM = jnp.where(mask_BxLxM[:, None, None], s_BxKxGxLxM, NEG_INF)
  p_BxKxGxLxM = jax.nn.softmax(s_BxKxGxLxM, axis=-1).astype(v_BxMxKxE.dtype)
  o_BxLxKxGxE = jnp.einsum("bkglm,bmke->blkge", p_BxKxGxLxM, v_BxMxKxE)
  return o_BxLxKxGxE.reshape(B, L, H, -1)  # v's head width may differ from q/k's (MLA)


def cached_attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, seg_BxT, cache):
  """Decoding: writes this chunk's k/v into the cache at slot `start`, then attends over the
  cache: a query at slot start+t sees slots <= start+t of its own segment (in cache `seg`)."""
  start = cache["start"]
  k_BxSxKxE = jax.lax.dynamic_update_slice(cache["k"], k_BxTxKxE.astype(cache["k"].dtype), (0, start, 0, 0))
  v_BxSxKxE = jax.lax.dynamic_update_slice(cache["v"], v_BxTxKxE.astype(cache["v"].dtype), (0, start, 0, 0))
  T, S = q_BxTxHxE.shape[1], k_BxSxKxE.shape[1]
  causal_TxS = jnp.arange(S)[None, :] <= start + jnp.arange(T)[:, None]
  same_BxTxS = seg_BxT[:, :, None] == cache["seg"][:, None, :]
  o_BxTxHxE = masked_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, causal_TxS & same_BxTxS)
  return o_BxTxHxE, {"k": k_BxSxKxE, "v": v_BxSxKxE}
