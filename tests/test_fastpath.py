"""The GPU fast path on CPU: attention selection, remat policies against no remat."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import attention, config, model as model_lib, step as step_lib
from jaxtrain.errors import UserError

CFG = config.load("tiny", ["model.dtype=float32", "model.n_layers=2", "model.d_model=32", "model.d_ff=64",
                           "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.vocab_size=64"]).model


def test_attention_selection_picks_the_reference_on_cpu():
  bf16 = dataclasses.replace(CFG, dtype="bfloat16", head_dim=64)
  impl, reason = attention.select(bf16, 128)
  assert impl == "xla" and "cpu" in reason
  assert attention.select(dataclasses.replace(bf16, attention="xla"))[0] == "xla"
  with pytest.raises(UserError, match="model.attention=cudnn is not supported here: backend is cpu"):
    attention.select(dataclasses.replace(bf16, attention="cudnn"), 128)


def test_attention_selection_rules_on_a_gpu():
  """The conditions, with the GPU probe replaced by (is CUDA GPU, max head_dim)."""
  bf16 = dataclasses.replace(CFG, dtype="bfloat16", head_dim=64)
  assert attention.select(bf16, 128, gpu_info=(True, 128))[0] == "cudnn"
  for cfg, seq, why in [(dataclasses.replace(bf16, dtype="float32"), 128, "model.dtype=float32"),
                        (dataclasses.replace(bf16, head_dim=60), 128, "model.head_dim=60"),
                        (dataclasses.replace(bf16, head_dim=192), 128, "model.head_dim=192"),
                        (bf16, 127, "train.seq_len=127")]:
    impl, reason = attention.select(cfg, seq, gpu_info=(True, 128))
    assert impl == "xla" and why in reason
    with pytest.raises(UserError, match=why):
      attention.select(dataclasses.replace(cfg, attention="cudnn"), seq, gpu_info=(True, 128))
  assert attention.select(dataclasses.replace(bf16, head_dim=192), 128, gpu_info=(True, 256))[0] == "cudnn"


def test_fused_call_masks_segments_like_the_reference():
  """The arguments `fused` gives jax.nn.dot_product_attention (causal + segment mask, GQA),
  run with its XLA implementation, against the model's reference; packed and unpacked."""
  rng = np.random.default_rng(0)
  B, L, H, K, E = 2, 12, 4, 2, 8
  q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(B, L, H, E), (B, L, K, E), (B, L, K, E)])
  for seg in (jnp.asarray([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12]), jnp.ones((B, L), jnp.int32)):
    f = lambda q, k, v: attention.fused(q, k, v, seg, implementation="xla")
    r = lambda q, k, v: model_lib.attention(q, k, v, seg)
    np.testing.assert_allclose(f(q, k, v), r(q, k, v), rtol=1e-5, atol=1e-5)
    gf = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    gr = jax.grad(lambda *a: jnp.sum(r(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(gf, gr):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _loss_and_grads(cfg):
  graphdef, params = nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))
  rng = np.random.default_rng(1)
  B, L = 2, 16
  toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, L + 1)), jnp.int32)
  seg = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)
  pos = jnp.asarray([list(range(9)) + list(range(7)), list(range(16))], jnp.int32)
  mb = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": pos, "segment_ids": seg,
        "loss_mask": jnp.ones((B, L), bool)}
  return jax.jit(jax.value_and_grad(lambda p: step_lib.token_loss_sum(graphdef, p, mb)))(params)


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_named", "offload_named"])
def test_remat_policy_gives_the_loss_and_gradients_of_none(policy):
  loss_ref, g_ref = _loss_and_grads(CFG)
  loss, g = _loss_and_grads(dataclasses.replace(CFG, remat=policy))
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
