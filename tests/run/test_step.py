"""Token-normalized accumulation and the optimizer pieces of the train step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.model import roles, transformer as model_lib
from jaxtrain.run import optimizer as optim_lib, step
from tests.helpers import grads_of, mesh_of


def _setup():
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=8"])
  graphdef, _ = model_lib.abstract(cfg.model)
  params = nnx.to_pure_dict(nnx.state(model_lib.Transformer(cfg.model, nnx.Rngs(0))))
  batch = {k: jnp.asarray(v) for k, v in next(data.batches(cfg)).items()}
  # Uneven valid-token counts: microbatch i (rows i, i+4 with k=4) keeps a different share.
  keep = np.array([128, 3, 60, 0, 128, 17, 90, 1])[:, None] > np.arange(128)[None, :]
  batch["loss_mask"] = batch["loss_mask"] * jnp.asarray(keep, jnp.int32)
  return cfg, graphdef, params, batch


def test_accumulation_equals_one_big_batch():
  cfg, graphdef, params, batch = _setup()
  counts = [int(batch["loss_mask"][i::4].sum()) for i in range(4)]
  assert len(set(counts)) == 4, counts  # the microbatches really differ in valid tokens
  loss1, g1, n1 = jax.jit(lambda p, b: grads_of(cfg, graphdef, p, b, microbatches=1))(params, batch)
  loss4, g4, n4 = jax.jit(lambda p, b: grads_of(cfg, graphdef, p, b, microbatches=4))(params, batch)
  assert int(n1) == int(n4) == sum(counts)
  np.testing.assert_allclose(loss4, loss1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_loss_is_the_mean_over_valid_tokens_of_the_whole_update():
  cfg, graphdef, params, batch = _setup()
  loss, _, _ = grads_of(cfg, graphdef, params, batch, microbatches=4)
  # Independent reference: per-token NLL from log_softmax, averaged over all valid tokens.
  logits = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"], batch["segment_ids"])
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]
  mask = batch["loss_mask"]
  np.testing.assert_allclose(loss, (nll * mask).sum() / mask.sum(), rtol=1e-6)
  # The wrong contract (mean of per-microbatch means) gives a visibly different number.
  per_mb = [(nll[i::4] * mask[i::4]).sum() / mask[i::4].sum() for i in range(4) if mask[i::4].sum() > 0]
  assert abs(float(np.mean(per_mb)) - float(loss)) > 1e-3


def test_lr_schedule_warms_up_then_decays_to_the_floor():
  cfg = config.load("tiny", ["train.steps=100", "optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr_ratio=0.1"])
  lr = optim_lib.lr_schedule(cfg.optim, cfg.train.steps)
  np.testing.assert_allclose([lr(0), lr(4), lr(9)], [0.1, 0.5, 1.0], rtol=1e-6)
  np.testing.assert_allclose([lr(10), lr(55), lr(100)], [1.0, 0.55, 0.1], rtol=1e-5)


def test_weight_decay_mask_covers_matrices_but_the_embedding():
  cfg = config.load("tiny", ["model.moe_experts=4", "model.moe_bias_rate=0.01"])
  _, state = model_lib.abstract(cfg.model)
  mask = roles.mask(cfg.model, nnx.to_pure_dict(state), "decayed")
  assert mask["layers"][0]["attn"]["wq"] and mask["layers"][1]["mlp"]["w_down"] and mask["lm_head"]
  assert mask["layers"][0]["mlp"]["router"]  # a matrix like the others (it was silently left out)
  assert not mask["embed"] and not mask["final_norm"]["scale"] and not mask["layers"][0]["attn_norm"]["scale"]
  assert not mask["layers"][0]["mlp"]["router_bias"]


def test_grad_norm_is_logged_before_clipping():
  cfg, graphdef, params, batch = _setup()
  _, g, _ = grads_of(cfg, graphdef, params, batch, microbatches=1)
  unclipped = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=8", "optim.grad_clip=1e-3"])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  _, metrics = setup.step(step.init_state(cfg, setup.opt, params), batch)
  assert unclipped > 1.0 and float(metrics["grad_norm"]) == pytest.approx(unclipped, rel=1e-5)


def test_a_non_finite_update_is_skipped_and_moves_nothing():
  params = {"w": jnp.ones((4,), jnp.float32)}
  opt = optax.sgd(1e38)
  state = opt.init(params)
  g = {"w": jnp.full((4,), 100.0)}  # finite gradient, step of 1e40: the new params overflow float32
  new, new_state, applied = jax.jit(lambda p, s, g: optim_lib.guarded_update(opt, p, s, g, True))(params, state, g)
  assert not bool(applied)
  np.testing.assert_array_equal(new["w"], params["w"])
  new, _, applied = optim_lib.guarded_update(optax.sgd(0.1), params, state, g, jnp.bool_(True))
  assert bool(applied) and float(new["w"][0]) == pytest.approx(1 - 10.0)


def test_adams_ratio_bound_holds_for_any_gradients_and_is_reached():
  """`adam_ratio_bound` against optax's own scale_by_adam on gradient histories: random, a spike then silence,
  and the Cauchy-Schwarz equality case (|g| at age k proportional to (b1/b2)^k), where the bound is reached."""
  o = config.load("tiny").optim
  adam = optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=0.0)
  T = 40
  rng = np.random.default_rng(0)
  equality = [(o.b1 / o.b2) ** (T - 1 - i) for i in range(T)]  # the last gradient is age 0
  for history in (rng.standard_normal(T) * 10.0 ** rng.uniform(-3, 3, T), [1e3] + [1e-6] * (T - 1), equality):
    state, worst = adam.init(jnp.zeros(())), []
    for t, g in enumerate(history, start=1):
      u, state = adam.update(jnp.float32(g), state)
      bound = float(optim_lib.adam_ratio_bound(o, t))
      assert abs(float(u)) <= bound * (1 + 1e-5), (t, float(u), bound)
      worst.append(abs(float(u)) / bound)
  assert float(optim_lib.adam_ratio_bound(o, 1)) == pytest.approx(1.0)
  assert worst[-1] == pytest.approx(1.0, rel=1e-4)  # equality case at the last step: the bound is tight
  assert optim_lib.adam_ratio_bound(dataclasses.replace(o, b1=0.99, b2=0.95), 3) is None  # b1^2 >= b2: no bound


def test_a_huge_learning_rate_is_caught_before_the_update_moves_anything():
  """The one-pass guard: with finite gradients an lr whose update could overflow a parameter skips the step
  (parameters, moments and schedule unmoved), decided before the update from max|p|, lr and Adam's bound; an lr
  whose update stays finite applies, as the old check of the new parameters would have."""
  base = ["model.dtype=float32", "train.batch_size=8", "optim.warmup_steps=0"]  # _setup's model and batch
  _, _, params, batch = _setup()
  for lr, applied in (("1e38", False), ("1e30", True)):
    cfg = config.load("tiny", [*base, f"optim.lr={lr}"])
    setup = step.Setup(cfg, mesh_of("dp=1"))
    state0 = step.init_state(cfg, setup.opt, params)
    keep = jax.tree.map(np.asarray, state0)
    state, metrics = setup.step(state0, batch)
    assert np.isfinite(float(metrics["grad_norm"])) and bool(metrics["skipped"]) is not applied
    moved = jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), b), state["params"], keep["params"])
    if applied:
      assert all(jax.tree.leaves(moved)) and int(state["step"]) == 1
      assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))
    else:
      assert not any(jax.tree.leaves(moved)) and int(state["step"]) == 0
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state["opt"], keep["opt"])


def test_finite_steps_match_plain_optax_adamw_on_a_plainly_written_loss():
  """Three finite steps of the trainer's step against the textbook update written here: the
  token-mean cross-entropy from log_softmax, jax.grad, global-norm clipping, optax.adamw with
  the warmup learning rates written out and decay on the projection matrices. A guard that
  touched a finite step (skipped it, kept part of the old state, moved the schedule wrong)
  is off by a whole update, ~lr = 6e-4 to 1.8e-3 per weight; even leaving out the weight decay
  of one group of matrices (0.1 lr |w|, ~2e-5) fails. Measured: at most ~1.2e-7 apart;
  asserted at 1e-6."""
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", "model.n_layers=2"])
  o = cfg.optim
  assert (o.lr, o.warmup_steps, o.b1, o.b2, o.eps, o.weight_decay, o.grad_clip) == (3e-3, 5, 0.9, 0.95, 1e-8, 0.1, 1.0)
  lrs = jnp.asarray([6e-4, 1.2e-3, 1.8e-3])  # warmup: 3e-3 * (step + 1) / 5
  decay = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, x: x.ndim >= 2 and path[0].key != "embed", p)  # projections, not the embedding table or norm scales
  ref_opt = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.adamw(lambda count: lrs[count], b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decay))
  setup = step.Setup(cfg, mesh_of("dp=1"))
  state = setup.init()
  params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state["params"])  # a copy: the step donates its input

  def loss_fn(p, b):
    logits = nnx.merge(setup.graphdef, p)(b["inputs"], b["positions"], b["segment_ids"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), b["targets"][..., None], -1)[..., 0]
    return (nll * b["loss_mask"]).sum() / b["loss_mask"].sum()

  @jax.jit
  def ref_step(p, opt_state, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    updates, opt_state = ref_opt.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss

  opt_state = ref_opt.init(params)
  it = data.batches(cfg)
  for i in range(3):
    local = next(it)
    state, metrics = setup.step(state, setup.device_batch(local))
    params, opt_state, ref_loss = ref_step(params, opt_state, {k: jnp.asarray(v) for k, v in local.items()})
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5, err_msg=f"step {i + 1}")
    assert not bool(metrics["skipped"])
  it.close()
  assert int(state["step"]) == 3
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state["params"]), jax.tree.leaves(params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))
