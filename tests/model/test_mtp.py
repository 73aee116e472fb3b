"""Multi-token prediction: weight 0 trains exactly as the plain model; weight w adds w x the mean cross-entropy of
the token after next, written out by hand here; an MoE MTP block's routing enters the aux loss and moves its bias."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.data import pipeline
from jaxtrain.core import config
from jaxtrain.model import transformer as model_lib
from jaxtrain.model.layers import rope_tables
from jaxtrain.run import grads as grads_lib, step
from tests.helpers import mesh_of, with_microbatches

FAST = {"xla_backend_optimization_level": 0}  # LLVM at -O0: half the compile time, same numbers


def _fast(fn, static, *args):
  return jax.jit(fn, static_argnums=static).lower(*args).compile(FAST)(*[a for i, a in enumerate(args)
                                                                           if i not in static])


def GRADS(cfg, graphdef, params, batch, k):
  """(loss, gradient, n_valid, MoE metrics) of the gradient contract with k microbatches."""
  objective = grads_lib.Objective(graphdef, with_microbatches(cfg, k))
  return jax.jit(lambda p, b: grads_lib.grads(objective, p, b)).lower(params, batch).compile(FAST)(params, batch)



SETS = ["model.dtype=float32", "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=4",
        "model.n_kv_heads=2", "model.head_dim=8", "train.batch_size=2", "train.seq_len=64"]


def _batch(B=2, L=64):
  """Packed rows of random tokens, documents of 9 to 40 tokens (several per row, cut at the row's end)."""
  rng = np.random.default_rng(0)
  seg = np.zeros((B, L + 1), np.int32)
  pos = np.zeros((B, L + 1), np.int32)
  for r in range(B):
    i, d = 0, 1
    while i < L + 1:
      n = min(int(rng.integers(9, 41)), L + 1 - i)
      seg[r, i:i + n], pos[r, i:i + n], i, d = d, np.arange(n), i + n, d + 1
  rows = {"tokens": rng.integers(0, 259, (B, L + 1)), "tokens_segment_ids": seg, "tokens_positions": pos}
  return jax.tree.map(jnp.asarray, pipeline.fields_from_rows(rows))


def _setup(*extra):
  cfg = config.load("tiny", SETS + list(extra))
  batch = _batch()
  model = model_lib.Transformer(cfg.model, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  return cfg, graphdef, nnx.to_pure_dict(params), batch


def _rms(x, w, eps):
  return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _reference_objective(graphdef, params, batch, w):
  """Mean next-token CE + w x mean CE of t_{i+2}, by hand: position i joins the embedding of t_{i+1} (its target)
  with the main hidden state, through the MTP layer and the shared head; it counts where t_{i+1} and t_{i+2} stay
  in its document."""
  model = nnx.merge(graphdef, params)
  p, eps = params["mtp"], model.cfg.norm_eps
  h = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])[0]
  head = model.head_weight()

  def ce(hid, t):
    logits = hid @ head
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, t[..., None], -1)[..., 0]
  m = batch["loss_mask"].astype(jnp.float32)
  main = jnp.sum(ce(h, batch["targets"]) * m) / jnp.sum(m)
  emb = params["embed"][batch["targets"]]
  x = jnp.concatenate([_rms(emb, p["enorm"]["scale"], eps), _rms(h, p["hnorm"]["scale"], eps)], -1) @ p["eh_proj"]
  x = model.mtp.block(x, rope_tables(batch["positions"], model.cfg), batch["segment_ids"])[0]
  g = _rms(x, p["head_norm"]["scale"], eps)
  t2 = jnp.concatenate([batch["targets"][:, 1:], batch["targets"][:, :1]], 1)
  m2 = (m * jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], 1))
  return main + w * jnp.sum(ce(g, t2) * m2) / jnp.sum(m2)


def test_weight_zero_trains_as_the_plain_model():
  cfg, graphdef, params, batch = _setup("model.mtp_layers=1")
  _, graphdef0, params0, _ = _setup()
  assert "mtp" in params and "mtp" not in params0
  params0 = {k: v for k, v in params.items() if k != "mtp"}  # the same main weights
  loss, g, _, _ = GRADS(cfg, graphdef, params, batch, 1)
  loss0, g0, _, _ = GRADS(cfg, graphdef0, params0, batch, 1)
  assert float(loss) == float(loss0)
  for a, b in zip(jax.tree.leaves({k: v for k, v in g.items() if k != "mtp"}), jax.tree.leaves(g0)):
    np.testing.assert_array_equal(a, b)
  assert all(not np.any(x) for x in jax.tree.leaves(g["mtp"]))


def test_weight_adds_the_hand_written_mtp_loss():
  cfg, graphdef, params, batch = _setup("model.mtp_layers=1", "model.mtp_weight=0.3")
  m = batch["loss_mask"]
  assert int(m.sum()) > int((m[:, :-1] * m[:, 1:]).sum()) > 0  # documents end inside rows: the MTP mask differs
  ref = jax.jit(jax.value_and_grad(_reference_objective, argnums=1), static_argnums=0).lower(
      graphdef, params, batch, 0.3).compile(FAST)
  (ref_value, ref_g), (base, _) = ref(params, batch, 0.3), ref(params, batch, 0.0)
  loss, g, _, _ = GRADS(cfg, graphdef, params, batch, 2)  # two microbatches: the MTP mean is over the whole update
  np.testing.assert_allclose(float(loss), float(base), rtol=1e-6)  # the logged loss: next-token CE alone
  assert float(ref_value) > float(base)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)


MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0", "model.moe_aux_weight=0.1",
       "model.moe_z_weight=0.01", "model.mtp_layers=1", "model.mtp_weight=0.3"]


def _aux_by_hand(m, stats):
  """jaxtrain's aux loss: the mean over MoE layers of aux_weight * X * sum f*P + z_weight * z."""
  return sum(m.moe_aux_weight * s["balance"] + m.moe_z_weight * s["z"] for s in stats) / len(stats)


@pytest.mark.slow
def test_an_moe_mtp_block_enters_the_aux_loss():
  """The MoE layers' stats are the model's layer and the MTP block's: the update's aux loss is their mean, and the
  gradient is the hand-written objective's with that aux term (on main the MTP block's routing was left out)."""
  cfg, graphdef, params, batch = _setup(*MOE, "model.n_layers=1")
  m = cfg.model

  def by_hand(params, batch):
    model = nnx.merge(graphdef, params)
    h, stats = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
    _, mtp_stats = model.mtp_hidden(h, batch["targets"], rope_tables(batch["positions"], m), batch["segment_ids"])
    return _aux_by_hand(m, [*stats, mtp_stats])
  aux, g_aux = jax.jit(jax.value_and_grad(by_hand))(params, batch)
  ref_g = jax.jit(jax.grad(_reference_objective, argnums=1), static_argnums=0)(graphdef, params, batch, 0.3)
  _, g, _, metrics = GRADS(cfg, graphdef, params, batch, 1)
  np.testing.assert_allclose(float(metrics["moe_aux_loss"]), float(aux), rtol=1e-5)
  assert metrics["moe_load"].shape == (2, 4)  # the model's layer and the MTP block
  router = lambda t: np.asarray(t["mtp"]["block"]["mlp"]["router"])  # noqa: E731
  np.testing.assert_allclose(router(g), router(ref_g) + router(g_aux), rtol=2e-4, atol=1e-7)
  assert np.abs(router(g_aux)).max() > 1e-3 * np.abs(router(ref_g)).max()  # the aux term is visible there


@pytest.mark.slow
def test_an_moe_mtp_block_moves_its_routing_bias():
  """Aux-loss-free balancing: after an applied update the MTP block's bias moves by rate * sign(mean load - load),
  its load counted from its own routing (on main it never moved)."""
  cfg, graphdef, params, batch = _setup(*MOE, "model.n_layers=1", "model.moe_bias_rate=0.01",
                                        "train.batch_size=2")
  setup = step.Setup(cfg, mesh_of("dp=1"))
  state = setup.init()
  p0 = jax.tree.map(np.asarray, state["params"])
  model = nnx.merge(setup.graphdef, p0)
  h, _ = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
  _, mtp_stats = model.mtp_hidden(h, batch["targets"], rope_tables(batch["positions"], cfg.model), batch["segment_ids"])
  load = np.asarray(mtp_stats["load"])
  want = p0["mtp"]["block"]["mlp"]["router_bias"] + 0.01 * np.sign(load.mean() - load)
  state, metrics = setup.step(state, batch)
  assert not bool(metrics["skipped"]) and np.any(load != load.mean())
  np.testing.assert_allclose(np.asarray(state["params"]["mtp"]["block"]["mlp"]["router_bias"]), want, rtol=1e-6)
