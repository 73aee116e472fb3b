"""LoRA adapters (jaxtrain.model.lora): the adapted model equals the plain model with the merged weights
W + A B * alpha / r (a reference without adapters), scanned or not; adapters carry their weight's logical axes."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain.core import config
from jaxtrain.model import lora, roles, transformer as model_lib

LORA = ["model.dtype=float32", "model.lora_rank=3", "model.lora_alpha=6", "model.lora_targets=q,k,v,o,gate,up,down"]


def _random_b(params):
  """Adapters with nonzero B (B starts at zero: the delta would vanish)."""
  keys = iter(jax.random.split(jax.random.key(1), 64))
  return jax.tree_util.tree_map_with_path(
      lambda path, x: 0.3 * jax.random.normal(next(keys), x.shape) if roles.keys_of(path)[-1] == "lora_b" else x,
      params)


@pytest.mark.parametrize("scan", [False, True])
def test_adapted_model_equals_the_plain_model_with_merged_weights(scan):
  cfg = config.load("tiny", [*LORA, f"model.scan_layers={str(scan).lower()}"]).model
  plain = dataclasses.replace(cfg, lora_rank=0)
  graphdef, state = nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))
  params = _random_b(nnx.to_pure_dict(state))
  merged = lora.merged(cfg, params, lambda path: roles.of(cfg, path).stacked)
  plain_graphdef, plain_state = nnx.split(model_lib.Transformer(plain, nnx.Rngs(0)))
  assert jax.tree.structure(merged) == jax.tree.structure(nnx.to_pure_dict(plain_state))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
  pos, seg = np.broadcast_to(np.arange(16), (2, 16)), np.ones((2, 16), np.int32)
  got = nnx.merge(graphdef, params)(tokens, pos, seg)
  want = nnx.merge(plain_graphdef, merged)(tokens, pos, seg)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  base = nnx.merge(graphdef, nnx.to_pure_dict(state))(tokens, pos, seg)  # B zero: the base model
  assert float(np.max(np.abs(got - base))) > 1e-2


def test_adapters_take_their_weights_axes_and_only_they_train():
  cfg = config.load("tiny", LORA).model
  _, state = model_lib.abstract(cfg)
  attn, mlp = state["layers"][0]["attn"], state["layers"][0]["mlp"]
  axes = lambda v: tuple(v.get_metadata()["axes"])  # noqa: E731
  assert axes(attn["wq_lora"]["lora_a"]) == ("embed", None) and axes(attn["wq_lora"]["lora_b"]) == (
      None, "heads", "head_dim")
  assert axes(attn["wo_lora"]["lora_a"]) == ("heads", "head_dim", None) and axes(attn["wo_lora"]["lora_b"]) == (
      None, "embed")
  assert axes(mlp["w_down_lora"]["lora_a"]) == ("mlp", None) and axes(mlp["w_down_lora"]["lora_b"]) == (None, "embed")
  trained, frozen = roles.split(cfg, nnx.to_pure_dict(state))
  assert all("_lora" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(trained))
  assert not any("_lora" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(frozen))
  assert jax.tree.structure(roles.join(trained, frozen)) == jax.tree.structure(nnx.to_pure_dict(state))
