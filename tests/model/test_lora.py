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


def _assert_same_logits(cfg, adapted, plain, base):
  """The adapted model's logits equal the plain model's with merged weights, and differ from the base's (B zero):
  each argument a (graphdef, params) pair."""
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
  pos, seg = np.broadcast_to(np.arange(16), (2, 16)), np.ones((2, 16), np.int32)
  got, want, zero = (nnx.merge(g, p)(tokens, pos, seg) for g, p in (adapted, plain, base))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert float(np.max(np.abs(got - zero))) > 1e-2


@pytest.mark.parametrize("scan", [False, True])
def test_adapted_model_equals_the_plain_model_with_merged_weights(scan):
  cfg = config.load("tiny", [*LORA, f"model.scan_layers={str(scan).lower()}"]).model
  plain = dataclasses.replace(cfg, lora_rank=0)
  graphdef, state = nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))
  params = _random_b(nnx.to_pure_dict(state))
  merged = lora.merged(cfg, params)
  plain_graphdef, plain_state = nnx.split(model_lib.Transformer(plain, nnx.Rngs(0)))
  assert jax.tree.structure(merged) == jax.tree.structure(nnx.to_pure_dict(plain_state))
  _assert_same_logits(cfg, (graphdef, params), (plain_graphdef, merged), (graphdef, nnx.to_pure_dict(state)))


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


# MoE (4 experts, a shared expert, dense first layer) and MLA (low-rank query, or one plain wq), tiny
MOE = ["model.d_model=32", "model.n_heads=4", "model.head_dim=8", "model.d_ff=64", "model.n_layers=2",
       "model.moe_experts=4", "model.moe_top_k=2", "model.moe_expert_d_ff=16", "model.moe_shared_experts=1",
       "model.moe_first_dense=1", "model.lora_targets=q,k,v,o,gate,up,down"]
MLA = ["model.d_model=32", "model.n_heads=4", "model.d_ff=64", "model.n_layers=2", "model.attention_type=mla",
       "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
       "model.v_head_dim=8", "model.lora_targets=q_a,q_b,kv_a,kv_b,o,gate,up,down"]
FAMILIES = {"moe": MOE, "mla": MLA,
            "mla_plain_q": [*MLA, "model.q_lora_rank=0", "model.lora_targets=q,kv_a,kv_b,o,down"]}


def _reference_merge(params, mult: float):
  """W + A B * mult for every adapter, in float32 numpy, from the shapes alone: A (*lead, *in, r), B (*lead, r,
  *out) with `lead` the axes W has beyond in and out (layers, experts): independent of jaxtrain.model.lora."""
  if not isinstance(params, dict):
    return params
  out = {k: _reference_merge(v, mult) for k, v in params.items() if not str(k).endswith("_lora")}
  for k, v in params.items():
    if str(k).endswith("_lora"):
      w, a, b = (np.asarray(x, np.float32) for x in (params[k[:-5]], v["lora_a"], v["lora_b"]))
      r = a.shape[-1]
      lead = a.ndim + b.ndim - 2 - w.ndim  # the leading axes A, B and W share
      a2 = a.reshape(*a.shape[:lead], -1, r)
      b2 = b.reshape(*b.shape[:lead], r, -1)
      out[k[:-5]] = w + (a2 @ b2).reshape(w.shape) * mult
  return out


def _family(name, extra=()):
  cfg = config.load("tiny", [*LORA, *FAMILIES[name], *extra]).model
  graphdef, state = nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))
  return cfg, graphdef, state, _random_b(nnx.to_pure_dict(state))


@pytest.mark.parametrize("name,scan", [("moe", False), ("moe", True), ("mla", False), ("mla", True),
                                       ("mla_plain_q", False)])
def test_moe_and_mla_adapted_equal_the_plain_model_with_merged_weights(name, scan):
  """Every expert's gate, up, down (A (X, in, r), B (X, r, out)), the shared expert's, and MLA's projections:
  the adapted model equals the plain one with W + A B s merged in the test (float32); lora.merged agrees."""
  cfg, graphdef, state, params = _family(name, [f"model.scan_layers={str(scan).lower()}"])
  want_params = _reference_merge(params, cfg.lora_alpha / cfg.lora_rank)
  plain_graphdef, plain_state = nnx.split(model_lib.Transformer(dataclasses.replace(cfg, lora_rank=0), nnx.Rngs(0)))
  assert jax.tree.structure(want_params) == jax.tree.structure(nnx.to_pure_dict(plain_state))
  ours = lora.merged(cfg, params)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), ours, want_params)
  _assert_same_logits(cfg, (graphdef, params), (plain_graphdef, want_params),
                      (graphdef, nnx.to_pure_dict(state)))


def test_moe_layer_adapts_every_expert_against_a_one_device_reference():
  """The MoE layer alone: each expert's adapter (its own A, B) merged in float32 by the test gives the same output
  as the layer with adapters; the adapters take the experts' axes and are all that trains."""
  from jaxtrain.model.moe import MoE
  cfg = config.load("tiny", [*LORA, *MOE]).model
  layer = MoE(cfg, nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  params = _random_b(nnx.to_pure_dict(state))
  assert params["w_gate_lora"]["lora_a"].shape == (4, 32, 3) and params["w_down_lora"]["lora_b"].shape == (4, 3, 32)
  x = jax.random.normal(jax.random.key(2), (2, 8, 32))
  got, _ = nnx.merge(graphdef, params)(x)
  s = cfg.lora_alpha / cfg.lora_rank
  want_params = {k: v for k, v in params.items() if not k.endswith("_lora")}
  for w in ("w_gate", "w_up", "w_down"):
    a, b = (np.asarray(params[f"{w}_lora"][k]) for k in ("lora_a", "lora_b"))
    want_params[w] = np.asarray(params[w]) + np.stack([a[e] @ b[e] for e in range(4)]) * s
  want_params["shared"] = _reference_merge(params["shared"], s)
  plain_graphdef, _ = nnx.split(MoE(dataclasses.replace(cfg, lora_rank=0), nnx.Rngs(0)))
  want, _ = nnx.merge(plain_graphdef, want_params)(x)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  base, _ = nnx.merge(graphdef, nnx.to_pure_dict(state))(x)
  assert float(np.max(np.abs(got - base))) > 1e-3
  axes = lambda v: tuple(v.get_metadata()["axes"])  # noqa: E731
  assert axes(state["w_gate_lora"]["lora_a"]) == ("experts", "embed", None)
  assert axes(state["w_gate_lora"]["lora_b"]) == ("experts", None, "mlp")
  assert axes(state["w_down_lora"]["lora_a"]) == ("experts", "mlp", None)


@pytest.mark.parametrize("name", ["moe", "mla"])
def test_only_the_adapters_of_moe_and_mla_train(name):
  cfg, _, state, params = _family(name)
  trained, frozen = roles.split(cfg, params)
  keys = lambda t: {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(t)}  # noqa: E731
  assert keys(trained) and all("_lora" in k for k in keys(trained))
  assert not any("_lora" in k for k in keys(frozen))
  want = ({"w_gate", "w_up", "w_down", "wq", "wk", "wv", "wo"} if name == "moe" else
          {"w_gate", "w_up", "w_down", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo"})
  assert {k.split("']['")[-2].removesuffix("_lora") for k in keys(trained)} == want
  if name == "moe":  # the experts' adapters and the shared expert's
    moe = trained["layers"][1]["mlp"]
    assert moe["w_up_lora"]["lora_a"].shape == (4, 32, 3) and "w_up_lora" in moe["shared"]


def _greedy_logits(model, tokens, prompt: int):
  """Logits of every position after the prompt: the prompt prefilled through the cache, then one token a step."""
  from jaxtrain.model.transformer import init_cache
  B, L = tokens.shape
  cache = init_cache(model.cfg, B, L)
  seg = np.ones((B, L), np.int32)
  pos = np.broadcast_to(np.arange(L), (B, L))
  out, cache = model.decode(tokens[:, :prompt], pos[:, :prompt], seg[:, :prompt], cache)
  outs = [out]
  for t in range(prompt, L):
    out, cache = model.decode(tokens[:, t:t + 1], pos[:, t:t + 1], seg[:, t:t + 1], cache)
    outs.append(out)
  return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("name", ["mla", "mla_plain_q"])
def test_mla_decoding_with_adapters_equals_the_full_forward(name):
  """MLA's decoding absorbs wkv_b into q and the output: with nonzero adapters, the merged kv_b there gives the
  logits of the training path's forward (x A B beside every projection)."""
  cfg, graphdef, _, params = _family(name)
  model = nnx.merge(graphdef, params)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
  full = model(tokens, np.broadcast_to(np.arange(12), (2, 12)), np.ones((2, 12), np.int32))
  np.testing.assert_allclose(_greedy_logits(model, tokens, 5), full, rtol=1e-4, atol=1e-4)
