"""Deferred weight gradients (jaxtrain.model.wgrad), the zero-bubble pipelines' W: a backward w.r.t. the activations,
the non-deferred parameters and the probes, then x^T dy per deferred projection, equals jax.grad of the whole chunk
w.r.t. every parameter (the reference), for dense, MLA and MoE layers, with and without remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.core import config
from jaxtrain.model import roles, transformer as model_lib, wgrad
from jaxtrain.model.layers import rope_tables

MLA = ["model.attention_type=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
       "model.qk_rope_head_dim=8", "model.v_head_dim=8"]
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_expert_d_ff=32", "model.moe_shared_experts=1"]


@pytest.mark.parametrize("extra", [["model.remat=none"], ["model.remat=full", *MLA], [*MOE, "model.remat=save_dots"]],
                         ids=["dense", "mla-remat", "moe"])
def test_weight_gradients_from_the_taps_equal_the_whole_backward(extra):
  cfg = config.load("tiny", ["model.dtype=float32", "model.scan_layers=true", "model.n_layers=2", *extra]).model
  graphdef, state = nnx.split(model_lib.Transformer(cfg, nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)
  layers, rest = params["layers"], {k: v for k, v in params.items() if k != "layers"}
  rows, L = 2, 16
  rng = np.random.default_rng(0)
  x, dy = (jnp.asarray(rng.normal(size=(rows, L, cfg.d_model)), jnp.float32) for _ in range(2))
  pos = jnp.broadcast_to(jnp.arange(L), (rows, L))

  def objective(c, x, probes=None):  # <chunk(x), dy>: its gradients are the chunk's vjp with dy
    c = c if probes is None else wgrad.wrap(c, deferred, probes)
    model = nnx.merge(graphdef, {**rest, "layers": c})
    y, _ = model_lib.run_stack(model.layers, x, rope_tables(pos, cfg), jnp.ones_like(pos), cfg.remat)
    return jnp.sum(y * dy)

  layer_roles = jax.tree.leaves(roles.tree(cfg, {"layers": layers}))
  deferred, n_in = [r.deferred for r in layer_roles], [r.n_in for r in layer_roles]
  names = [roles.keys_of(p)[-1] for p, _ in jax.tree_util.tree_flatten_with_path(layers)[0]]
  # every projection of attention and the dense (or shared) MLP is deferred; experts, router and norms are not
  assert {n for n, d in zip(names, deferred) if d} >= ({"wq_a", "wq_b", "wkv_a", "wkv_b", "wo"} if MLA[0] in extra
                                                       else {"wq", "wk", "wv", "wo"})
  assert not any(d for n, d in zip(names, deferred) if n in ("scale", "router"))
  probes = wgrad.zero_probes(layers, deferred, n_in, (rows, L), 1, jnp.float32)
  got, (g_x,), kept = jax.jit(lambda c, x, p: wgrad.split_grad(objective, c, deferred, p, x, argnums=(0,)))(
      layers, x, probes)
  got.update({i: wgrad.weight_grad(a, b, lead=1) for i, (a, b) in zip([i for i, d in enumerate(deferred) if d], kept)})
  want_w, want_x = jax.jit(jax.grad(objective, argnums=(0, 1)))(layers, x)
  np.testing.assert_allclose(g_x, want_x, rtol=1e-5, atol=1e-6)
  for i, (name, want) in enumerate(zip(names, jax.tree.leaves(want_w))):
    assert float(jnp.max(jnp.abs(want))) > 0, name
    np.testing.assert_allclose(got[i], want, rtol=1e-4, atol=1e-6, err_msg=name)
