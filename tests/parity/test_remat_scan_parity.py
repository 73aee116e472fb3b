"""Remat policies and scanned layers against the plain model: the same loss and gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.core import config
from jaxtrain.model import transformer as model_lib
from jaxtrain.run import grads as grads_lib

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


CFG = config.load("tiny", ["model.dtype=float32", "model.n_layers=2", "model.d_model=32", "model.d_ff=64",
                           "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.vocab_size=64"]).model


@functools.lru_cache(maxsize=None)
def _loss_and_grads(cfg):
  return _loss_and_grads_of(*nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0))))


def _loss_and_grads_of(graphdef, params):
  rng = np.random.default_rng(1)
  B, L = 2, 16
  toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, L + 1)), jnp.int32)
  seg = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)
  pos = jnp.asarray([list(range(9)) + list(range(7)), list(range(16))], jnp.int32)
  mb = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "positions": pos, "segment_ids": seg,
        "loss_mask": jnp.ones((B, L), bool)}
  model_cfg = nnx.merge(graphdef, params).cfg
  objective = grads_lib.Objective(graphdef, dataclasses.replace(config.load("tiny"), model=model_cfg))
  return jax.jit(jax.value_and_grad(lambda p: objective.loss_sum(p, mb)))(params)


@pytest.mark.parametrize("policy", ["full", "save_dots", "save_named", "offload_named"])
def test_remat_policy_gives_the_loss_and_gradients_of_none(policy):
  loss_ref, g_ref = _loss_and_grads(CFG)
  loss, g = _loss_and_grads(dataclasses.replace(CFG, remat=policy))
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _restack(params_unscanned, n_layers, dense=0):
  """The unscanned pure params with layers/dense..n-1 stacked into one `layers` subtree, and the `dense` first
  ones into `dense_layers` (MaxText's two stacks)."""
  pure = nnx.to_pure_dict(params_unscanned)
  stack = lambda idx: jax.tree.map(lambda *xs: jnp.stack(xs), *[pure["layers"][i] for i in idx])  # noqa: E731
  return {**pure, "layers": stack(range(dense, n_layers)), **({"dense_layers": stack(range(dense))} if dense else {})}


@pytest.mark.parametrize("extra", [{}, {"remat": "full"}, {"moe_experts": 4, "moe_top_k": 2, "moe_first_dense": 1}])
def test_scanned_layers_give_the_loss_and_gradients_of_unscanned(extra):
  """With a dense first layer (DeepSeek-V3, Qwen3-MoE's mlp_only_layers): a dense stack, then the MoE stack."""
  cfg = dataclasses.replace(CFG, n_layers=3, **extra)
  loss_ref, g_ref = _loss_and_grads(cfg)
  scanned = dataclasses.replace(cfg, scan_layers=True)
  graphdef, params = nnx.split(model_lib.Transformer(scanned, nnx.Rngs(0)))
  # Same weights: the unscanned model's, restacked independently of model.stack_blocks.
  _, unscanned_params = nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))
  nnx.replace_by_pure_dict(params, _restack(unscanned_params, cfg.n_layers, cfg.moe_first_dense))
  loss, g = _loss_and_grads_of(graphdef, params)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  expected = _restack(g_ref, cfg.n_layers, cfg.moe_first_dense)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(g)), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  # The stacked params carry the `layers` logical axis first.
  axes = {v.get_metadata()["axes"] for _, v in nnx.iter_graph(model_lib.Transformer(scanned, nnx.Rngs(0)).layers)
          if isinstance(v, nnx.Param)}
  assert all(a[0] == "layers" for a in axes)
