"""The reference attention kernels, plain math: causal grouped-query attention within segments (training), and
over a KV cache (decoding). Which kernel a run uses is the execution plan's choice (jaxtrain.parallel.kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a fully masked row (padding) gives no NaN


def attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, seg_BxL, logits_dtype=jnp.float32, window: int = 0, sinks_H=None):
  """Causal grouped-query attention; a token sees only earlier tokens of its own segment, and with a `window` > 0
  only the last `window` of them (itself included). Scores and softmax in `logits_dtype`
  (model.attention_logits_dtype); `sinks_H`: each head's sink logit joins the softmax's denominator."""
  L = q_BxLxHxE.shape[1]
  pos_L = jnp.arange(L)
  causal_LxL = visible(pos_L[:, None], pos_L[None, :], window)
  same_BxLxL = seg_BxL[:, :, None] == seg_BxL[:, None, :]
  return masked_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, causal_LxL & same_BxLxL, logits_dtype, sinks_H)


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


def visible(q_pos, k_pos, window):
  """Whether a query at `q_pos` sees a key at `k_pos` (broadcasting): causal, and within `window` tokens (0: no
  limit; a traced window too)."""
  past = k_pos <= q_pos
  return past if isinstance(window, int) and not window else past & ((window == 0) | (q_pos - k_pos < window))


def masked_attention(q_BxLxHxE, k_BxMxKxE, v_BxMxKxE, mask_BxLxM, logits_dtype=jnp.float32, sinks_H=None):
  """GQA of L queries over M keys where `mask_BxLxM` allows (M = L in training, the
  cache length when decoding); `sinks_H`: a per-head logit in the denominator only."""
  B, L, H, E = q_BxLxHxE.shape
  K = k_BxMxKxE.shape[2]
  q_BxLxKxGxE = q_BxLxHxE.reshape(B, L, K, H // K, E)
  s_BxKxGxLxM = jnp.einsum("blkge,bmke->bkglm", q_BxLxKxGxE, k_BxMxKxE,
                           preferred_element_type=logits_dtype) * jnp.asarray(E**-0.5, logits_dtype)
  s_BxKxGxLxM = jnp.where(mask_BxLxM[:, None, None], s_BxKxGxLxM, NEG_INF)
  if sinks_H is None:
    p_BxKxGxLxM = jax.nn.softmax(s_BxKxGxLxM, axis=-1)
  else:  # the sink as one more column of the softmax, dropped after it
    sink_BxKxGxLx1 = jnp.broadcast_to(sinks_H.astype(logits_dtype).reshape(1, K, H // K, 1, 1),
                                      (*s_BxKxGxLxM.shape[:-1], 1))
    p_BxKxGxLxM = jax.nn.softmax(jnp.concatenate([s_BxKxGxLxM, sink_BxKxGxLx1], axis=-1), axis=-1)[..., :-1]
  o_BxLxKxGxE = jnp.einsum("bkglm,bmke->blkge", p_BxKxGxLxM.astype(v_BxMxKxE.dtype), v_BxMxKxE)
  return o_BxLxKxGxE.reshape(B, L, H, -1)  # v's head width may differ from q/k's (MLA)


def cached_attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, seg_BxT, cache, sinks_H=None):
  """Decoding: writes this chunk's k/v into the cache at slot `start`, then attends over the
  cache: a query at slot start+t sees slots <= start+t of its own segment (in cache `seg`)."""
  start = cache["start"]
  k_BxSxKxE = jax.lax.dynamic_update_slice(cache["k"], k_BxTxKxE.astype(cache["k"].dtype), (0, start, 0, 0))
  v_BxSxKxE = jax.lax.dynamic_update_slice(cache["v"], v_BxTxKxE.astype(cache["v"].dtype), (0, start, 0, 0))
  T, S = q_BxTxHxE.shape[1], k_BxSxKxE.shape[1]
  causal_TxS = jnp.arange(S)[None, :] <= start + jnp.arange(T)[:, None]
  same_BxTxS = seg_BxT[:, :, None] == cache["seg"][:, None, :]
  o_BxTxHxE = masked_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, causal_TxS & same_BxTxS, sinks_H=sinks_H)
  return o_BxTxHxE, {"k": k_BxSxKxE, "v": v_BxSxKxE}


def windowed_cached_attention(q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, seg_BxT, cache, window: int, sinks_H=None):
  """Decoding a local layer: its cache is a ring of W <= `window` slots (slot s holds the latest cache slot a = s
  mod W before `start`), so it never holds more than the window. The chunk attends over the ring and itself (a
  prompt longer than the window needs its own earlier keys), then its last W keys replace the ring's oldest."""
  start, ring_k, ring_v = cache["start"], cache["k"], cache["v"]
  T, W = q_BxTxHxE.shape[1], ring_k.shape[1]
  slot_W = start - 1 - jnp.mod(start - 1 - jnp.arange(W), W)  # the cache slot each ring slot holds (< 0: none)
  seg_BxW = jnp.where(slot_W >= 0, jnp.take(cache["seg"], jnp.maximum(slot_W, 0), axis=1), -1)
  slot_T = start + jnp.arange(T)
  keys_M, seg_BxM = jnp.concatenate([slot_W, slot_T]), jnp.concatenate([seg_BxW, seg_BxT], axis=1)
  mask_BxTxM = visible(slot_T[:, None], keys_M[None, :], window)[None] & (seg_BxT[:, :, None] == seg_BxM[:, None, :])
  k_BxMxKxE = jnp.concatenate([ring_k, k_BxTxKxE.astype(ring_k.dtype)], axis=1)
  v_BxMxKxE = jnp.concatenate([ring_v, v_BxTxKxE.astype(ring_v.dtype)], axis=1)
  o_BxTxHxE = masked_attention(q_BxTxHxE, k_BxMxKxE, v_BxMxKxE, mask_BxTxM, sinks_H=sinks_H)
  n = min(T, W)  # only the chunk's last W keys can be seen again
  put_n = jnp.mod(start + T - n + jnp.arange(n), W)
  return o_BxTxHxE, {"k": ring_k.at[:, put_n].set(k_BxMxKxE[:, -n:]), "v": ring_v.at[:, put_n].set(v_BxMxKxE[:, -n:])}
