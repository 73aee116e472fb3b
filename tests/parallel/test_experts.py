"""Mixture of experts: the expert-parallel layer against a dense one-device reference,
dropped-token counting against a hand count, presets, and metrics."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.run import loop
from jaxtrain.core import config
from jaxtrain.model import moe, transformer as model_lib
from tests.helpers import mesh_of, moe_ffn, plan_of


def _silu(x):
  return x / (1 + np.exp(-x))


def _dense_reference(x, router, wg, wu, wd, top_k):
  """Every token through its top-k experts, looping in numpy (no capacity, no buffers)."""
  x, router, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, router, wg, wu, wd))
  logits = x @ router
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for idx in np.ndindex(*x.shape[:-1]):
    chosen = np.argsort(-probs[idx])[:top_k]
    w = probs[idx][chosen] / probs[idx][chosen].sum()
    for e, we in zip(chosen, w):
      out[idx] += we * ((_silu(x[idx] @ wg[e]) * (x[idx] @ wu[e])) @ wd[e])
  return out


def _weights(rng, D, X, F):
  return (jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)
          for s, sc in [((D, X), 1.0), ((X, D, F), 0.3), ((X, D, F), 0.3), ((X, F, D), 0.3)])


def _layer(mesh, **kw):
  plan = plan_of(mesh, "model.moe_experts=8")
  assert plan.moe == "all_to_all"
  return jax.jit(lambda *args: moe_ffn(*args, **kw, plan=plan))


@pytest.mark.parametrize("spec", ["ep=4", "ep=2,fsdp=2,tp=2"])
def test_expert_parallel_layer_equals_dense_reference(spec):
  rng = np.random.default_rng(0)
  B, L, D, X, F, k = 8, 6, 16, 8, 12, 2
  x = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
  router, wg, wu, wd = _weights(rng, D, X, F)
  mesh = mesh_of(spec)
  compiled = _layer(mesh, top_k=k, capacity_factor=0.0).lower(x, router, wg, wu, wd).compile()
  y, stats = compiled(x, router, wg, wu, wd)
  np.testing.assert_allclose(y, _dense_reference(x, router, wg, wu, wd, k), rtol=1e-4, atol=1e-5)
  assert float(stats["dropped"]) == 0 and float(stats["assigned"]) == B * L * k
  # Dispatch and combine are all-to-alls; each device's expert matmuls see only its X/ep experts.
  hlo = compiled.as_text()
  assert "all-to-all" in hlo
  shapes = [tuple(map(int, d)) for d in re.findall(r"= f32\[(\d+),(\d+),(\d+)\]\S* dot\(", hlo)]
  expert_dots = [s for s in shapes if s[2] in (D, F // mesh.shape["tensor"])]  # (experts, tokens, D or F)
  assert expert_dots and {s[0] for s in expert_dots} == {X // mesh.shape["expert"]}, shapes



def test_expert_ffn_never_all_gathers_its_buffers_over_fsdp():
  """The experts' buffers (Xl, slots, D) and hidden (Xl, slots, F) keep their slots split
  over fsdp: the weights move, never the activations (mixtral-8x7b once all-gathered 4.4
  GiB of hidden per layer over fsdp in its backward)."""
  rng = np.random.default_rng(0)
  B, L, D, X, F, k = 8, 16, 16, 4, 24, 2
  x = jnp.asarray(rng.standard_normal((B, L, D)), jnp.float32)
  ws = tuple(_weights(rng, D, X, F))
  plan = plan_of(mesh_of("fsdp=2,ep=2"), "model.moe_experts=4")

  def loss(x, *w):
    return jnp.sum(moe_ffn(x, *w, top_k=k, capacity_factor=1.0, plan=plan)[0] ** 2)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, *ws).compile().as_text()
  gathered = [tuple(map(int, s.split(","))) for s in re.findall(r"= \w+\[([\d,]+)\]\S* all-gather\(", hlo)]
  buffers = [s for s in gathered if len(s) == 3 and s[0] == X // 2 and s[2] in (D, F)]
  assert not buffers, gathered

def test_dropped_tokens_match_a_hand_count():
  """Top-1, 4 experts, capacity ceil(1.0 * 8 tokens * 1 / 4) = 2 per expert and group (one row).

  Row 0 (device 0) sends tokens to experts 0,0,1,0,0,2,0,3: expert 0 gets 5, keeps its first
  2 (tokens 0, 1) and drops tokens 3, 4, 6. Row 1 (device 1) sends all 8 to expert 3: 6 drop.
  """
  D = X = 4
  experts = np.array([[0, 0, 1, 0, 0, 2, 0, 3], [3] * 8])
  x = jnp.asarray(np.eye(D)[experts] + 0.01, jnp.float32)  # token t points at expert experts[t]
  rng = np.random.default_rng(1)
  _, wg, wu, wd = _weights(rng, D, X, 5)
  router = jnp.eye(D, X) * 20.0
  y, stats = _layer(mesh_of("ep=2"), top_k=1, capacity_factor=1.0)(x, router, wg, wu, wd)
  assert float(stats["dropped"]) == 3 + 6 and float(stats["assigned"]) == 16
  dropped = np.zeros((2, 8), bool)
  dropped[0, [3, 4, 6]] = True
  dropped[1, 2:] = True
  ref = _dense_reference(x, router, wg, wu, wd, 1)
  np.testing.assert_array_equal(np.asarray(y)[dropped], 0.0)  # dropped: nothing added to the residual
  np.testing.assert_allclose(np.asarray(y)[~dropped], ref[~dropped], rtol=1e-4, atol=1e-5)
  # Groups are one sequence by default, whatever the mesh: one device drops the same.
  y1, stats = jax.jit(lambda *a: moe_ffn(*a, top_k=1, capacity_factor=1.0))(
      x, router, wg, wu, wd)
  assert float(stats["dropped"]) == 3 + 6
  np.testing.assert_allclose(y1, y, rtol=1e-6, atol=1e-6)
  # One group of both rows (16 tokens): capacity 4 per expert. Expert 0 gets 5 (drops 1),
  # expert 3 gets 9 (drops 5).
  _, stats = jax.jit(lambda *a: moe_ffn(*a, top_k=1, capacity_factor=1.0, group_size=16))(x, router, wg, wu, wd)
  assert float(stats["dropped"]) == 1 + 5

  # Generation feeds fewer positions than a group of 64: each row's fed positions are one
  # group there, exactly as with the default group size (same drops, same output).
  y64, stats = jax.jit(lambda *a: moe_ffn(*a, top_k=1, capacity_factor=1.0, group_size=64))(x, router, wg, wu, wd)
  assert float(stats["dropped"]) == 3 + 6
  np.testing.assert_array_equal(y64, y1)

def test_router_losses_are_one_and_known_when_uniform():
  """A zero router: uniform probabilities, load balance X * sum(f_e / X) = 1, z = log(X)^2."""
  x = jnp.ones((2, 4, 8))
  _, _, stats = moe.route(x, jnp.zeros((8, 4)), top_k=2)
  np.testing.assert_allclose(stats["balance"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(stats["z"], np.log(4.0) ** 2, rtol=1e-6)


def test_mixtral_parameter_count():
  _, state = model_lib.abstract(config.load("mixtral-8x7b").model)
  assert model_lib.param_count(state) == 46_702_792_704


def test_moe_config_errors():
  with pytest.raises(config.UserError, match="moe_top_k=5"):
    config.load("moe-tiny", ["model.moe_top_k=5"])


@pytest.mark.slow
def test_metrics_log_moe_fields(tmp_path):
  cfg = config.load("moe-tiny", ["train.batch_size=4", "train.seq_len=32", "model.n_layers=1",
                                  "model.moe_capacity_factor=0.5"])
  summary = loop.run(cfg, mesh_of("ep=2"), tmp_path, "moe-tiny", stop_at=2)
  lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert len(lines) == summary.steps == 2 and lines[-1] == summary.last
  for rec in lines:
    assert 0 < rec["moe_dropped_frac"] < 1  # capacity 0.5 must drop some assignments
    assert rec["moe_aux_loss"] > 0
    assert 1 <= rec["moe_load_imbalance"] <= 4  # max/mean over 4 experts


def test_moe_flops_count_the_active_experts_only():
  """Matmul weights per token = every parameter but the lookup table and norms, less the
  experts a token does not visit (X - k per MoE layer)."""
  from jaxtrain.model import flops
  m = config.load("moe-tiny", ["model.moe_every=2"]).model
  _, state = model_lib.abstract(m)
  norms = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(state) if "norm" in jax.tree_util.keystr(path))
  idle = (m.moe_experts - m.moe_top_k) * 3 * m.d_model * m.d_ff  # one MoE layer (layer 1 of 2)
  want = model_lib.param_count(state) - m.vocab_size * m.d_model - norms - idle
  assert flops.matmul_params(m) == want


@pytest.mark.slow
@pytest.mark.parametrize("group", [2, 3])
def test_a_prompt_generates_the_same_tokens_alone_and_in_a_batch(group):
  """Capacity groups of decoding stay within a row: with tight capacity (drops), a prompt's greedy output
  does not depend on which other prompts share its batch."""
  from flax import nnx
  from jaxtrain.interop import decode
  cfg = config.load("moe-tiny", ["model.dtype=float32", "model.moe_capacity_factor=0.5",
                                 f"model.moe_group_size={group}", "train.seq_len=16", "model.init_std=0.3"])
  model = model_lib.Transformer(cfg.model, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  prompts = [[5, 6, 7, 8, 9, 10], [3, 4, 90, 91, 92, 93], [200, 17, 17, 40, 41, 300]]
  gen = lambda ps: decode.generate(cfg, mesh_of("fsdp=1"), graphdef, params, ps, 6)  # noqa: E731
  alone = gen(prompts[:1])[0]
  assert gen(prompts[:2])[0] == alone and gen(prompts)[0] == alone


def test_a_moe_resume_with_another_microbatch_split_is_refused():
  """The aux loss's batch statistics and the capacity groups follow the microbatch split: for a MoE
  model train.microbatches is a math key of the resume check; for a dense one it is not."""
  from jaxtrain.run import checkpoint
  for name, refused in (("moe-tiny", True), ("tiny", False)):
    saved = checkpoint.fingerprint(config.load(name), "tok", "data")
    found = checkpoint.mismatches(saved, checkpoint.fingerprint(config.load(name, ["train.microbatches=2"]), "tok", "data"))
    assert found == ({"train": "train.microbatches: 1 -> 2"} if refused else {}), (name, found)
