"""GPT-OSS's pieces against `transformers`' own modules (GptOssMLP: biased router, biased experts, the clamped
SwiGLU; GptOssAttention: q/k/v/o biases with sinks and a window), on every expert dispatch path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

from flax import nnx  # noqa: E402
from transformers import GptOssConfig  # noqa: E402

from jaxtrain.core import config  # noqa: E402
from jaxtrain.model import activation, block, moe, ops  # noqa: E402
from jaxtrain.model.layers import rope_tables  # noqa: E402
from tests.helpers import mesh_of, plan_of  # noqa: E402

B, L, D, X, F, K = 2, 8, 16, 8, 12, 2


def _hf_mlp(seed=0):
  """A random GptOssMLP whose gates and ups reach past the clamp (limit 7) for some tokens."""
  torch.manual_seed(seed)
  cfg = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=X, num_experts_per_tok=K,
                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4, vocab_size=32)
  mlp = gpt_oss.GptOssMLP(cfg).float()
  with torch.no_grad():
    for p, std in ((mlp.router.weight, 1.0), (mlp.router.bias, 1.0), (mlp.experts.gate_up_proj, 1.5),
                   (mlp.experts.gate_up_proj_bias, 1.0), (mlp.experts.down_proj, 0.3),
                   (mlp.experts.down_proj_bias, 1.0)):
      p.normal_(0, std)
  return mlp


def _ours(mlp):
  """(router (D, X), its bias, weights with biases) in jaxtrain's layout: gate and up de-interleaved."""
  t = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
  gu, gub = mlp.experts.gate_up_proj, mlp.experts.gate_up_proj_bias
  weights = (t(gu[..., ::2]), t(gu[..., 1::2]), t(mlp.experts.down_proj), t(gub[:, ::2]), t(gub[:, 1::2]),
             t(mlp.experts.down_proj_bias))
  return t(mlp.router.weight).T, t(mlp.router.bias), weights


def _moe(x, router, rbias, weights, plan, cap_factor):
  idx, w, _ = moe.route(x, router, K, logit_bias_X=rbias)
  cap = None if cap_factor is None else moe.capacity(L, X, K, cap_factor)
  act = activation.of(config.load("tiny", ["model.mlp_activation=swiglu_clamped"]).model)
  with ops.use(plan or ops.Ops()):
    return ops.current().experts(x, idx, w, weights, L, cap, act)[0]


PATHS = {  # name: (mesh spec or None, plan's extra keys, capacity factor or None: dropless)
    "one_device_ragged": (None, [], None),
    "one_device_capacity": (None, [], 0.0),
    "blocks": ("data=1", ["model.moe_dropless=true", "model.moe_grouped_matmul=blocks"], None),
    "ep2_dropless_blocks": ("ep=2", ["model.moe_dropless=true", "model.moe_grouped_matmul=blocks"], None),
    "ep8_dropless_one_expert": ("ep=8", ["model.moe_dropless=true"], None),
    "ep2_capacity": ("ep=2,tp=2", [], 0.0),
}


@pytest.mark.parametrize("path", PATHS)
def test_biased_clamped_experts_equal_transformers_on_every_dispatch_path(path):
  mlp = _hf_mlp()
  x = np.random.default_rng(1).standard_normal((B, L, D)).astype(np.float32) * 2
  want = mlp(torch.from_numpy(x))[0].detach().numpy()
  spec, sets, cap_factor = PATHS[path]
  plan = None if spec is None else plan_of(mesh_of(spec), "model.moe_experts=8", *sets)
  router, rbias, weights = _ours(mlp)
  got = jax.jit(lambda *a: _moe(*a, plan=plan, cap_factor=cap_factor))(jnp.asarray(x), router, rbias, weights)
  assert np.abs(want).max() > 1.0  # the clamp and the biases matter at this scale
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_a_dense_mlp_takes_the_clamped_activation_too():
  """model.mlp_activation reaches the dense MLP: against a numpy reference of GPT-OSS's formula."""
  cfg = config.load("tiny", ["model.mlp_activation=swiglu_clamped", "model.swiglu_alpha=1.5",
                             "model.swiglu_limit=2.0", "model.dtype=float32"]).model
  from jaxtrain.model.layers import MLP
  mlp = MLP(cfg, nnx.Rngs(0))
  x = np.random.default_rng(2).standard_normal((2, 5, cfg.d_model)).astype(np.float32) * 20
  wg, wu, wd = (np.asarray(getattr(mlp, w)[...], np.float64) for w in ("w_gate", "w_up", "w_down"))
  g, u = np.minimum(x @ wg, 2.0), np.clip(x @ wu, -2.0, 2.0)
  want = (g / (1 + np.exp(-1.5 * g)) * (u + 1)) @ wd
  assert np.abs(x @ wg).max() > 2.0  # the clamp bites
  np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x))), want, rtol=1e-4, atol=1e-5)
