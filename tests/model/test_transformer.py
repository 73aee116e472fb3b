"""Attention isolation for packed documents, and the attention math against a plain loop."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.model import attention as attention_lib
from jaxtrain.core import config
from jaxtrain.model import transformer as model_lib

CFG = config.load("tiny", ["model.dtype=float32"]).model


def _row(doc_a, doc_b, length=32):
  """One packed row: doc A (segment 1), doc B (segment 2), then padding (segment 0)."""
  toks = np.zeros(length, np.int32)
  seg = np.zeros(length, np.int32)
  pos = np.zeros(length, np.int32)
  a, b = len(doc_a), len(doc_b)
  toks[:a], toks[a:a + b] = doc_a, doc_b
  seg[:a], seg[a:a + b] = 1, 2
  pos[:a], pos[a:a + b] = np.arange(a), np.arange(b)
  return jnp.asarray(toks)[None], jnp.asarray(pos)[None], jnp.asarray(seg)[None]


def test_packed_documents_do_not_see_each_other():
  model = model_lib.Transformer(CFG, nnx.Rngs(0))
  rng = np.random.default_rng(0)
  doc_a, doc_b = rng.integers(3, 259, 12), rng.integers(3, 259, 9)
  base = model(*_row(doc_a, doc_b))
  # Changing document B leaves every logit of document A unchanged, and vice versa.
  other_b = model(*_row(doc_a, rng.integers(3, 259, 9)))
  np.testing.assert_array_equal(base[0, :12], other_b[0, :12])
  assert not np.allclose(base[0, 12:21], other_b[0, 12:21])
  other_a = model(*_row(rng.integers(3, 259, 12), doc_b))
  np.testing.assert_array_equal(base[0, 12:21], other_a[0, 12:21])
  # Document B packed second gives the logits it gets alone at the start of a row.
  alone = model(*_row(doc_b, np.array([], np.int32)))
  np.testing.assert_allclose(base[0, 12:21], alone[0, :9], rtol=1e-5, atol=1e-5)


def test_attention_matches_a_plain_loop():
  rng = np.random.default_rng(1)
  B, L, H, K, E = 2, 10, 4, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E)])
  seg = jnp.asarray([[1] * 6 + [2] * 4, [1] * 10])
  out = attention_lib.attention(q, k, v, seg)
  ref = np.zeros((B, L, H, E), np.float32)
  for b in range(B):
    for h in range(H):
      kv = h // (H // K)  # query head h reads kv head h // group
      for i in range(L):
        js = [j for j in range(i + 1) if seg[b, j] == seg[b, i]]
        s = np.array([q[b, i, h] @ k[b, j, kv] for j in js]) / np.sqrt(E)
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        ref[b, i, h] = sum(pj * v[b, j, kv] for pj, j in zip(p, js))
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_share_the_table():
  cfg = config.load("tiny", ["model.tie_embeddings=true"]).model
  _, state = model_lib.abstract(cfg)
  params = nnx.to_pure_dict(state)
  assert "lm_head" not in params
  assert model_lib.param_count(state) == model_lib.param_count(model_lib.abstract(CFG)[1]) - 128 * 512
