"""Mixture of experts: the same run on every mesh at the default capacity factor
(tokens do drop), dropless grouped matmuls against dense references (ours and Hugging
Face's Mixtral), DeepSeek-style options against plain references, the aux-free bias."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data
from jaxtrain.run import checkpoint
from jaxtrain.core import config
from jaxtrain.model import moe, moe_balance, transformer as model_lib
from jaxtrain.model.layers import MLP
from jaxtrain.model.moe import MoE
from jaxtrain.parallel import expert_layout as moe_layout
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.run import step
from jaxtrain.core.errors import UserError
from tests.helpers import mesh_of, moe_ffn

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

STEPS = 3
# moe-tiny (4 experts, top-2, both layers MoE) at the default capacity factor 1.25, float32,
# at the smallest widths that keep its structure (compiles dominate the time). Layers
# scanned: one traced block, half the compile time of two. 8 rows of 16 tokens: whole
# sequences on every device of every mesh below, so one-sequence groups fit.
SHAPES = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.d_ff=64",
          "model.dtype=float32"]
TINY = SHAPES + ["train.batch_size=8", "train.seq_len=16", "model.scan_layers=true"]
CAP = config.load("moe-tiny", TINY)
DROPLESS = config.load("moe-tiny", TINY + ["model.moe_dropless=true"])
_INITIAL: dict = {}


def _initial(cfg, setup):
  """The initial train state of `cfg` on the host, computed once (every mesh then starts
  from the same arrays, and only the step is compiled per mesh)."""
  if id(cfg) not in _INITIAL:
    _INITIAL[id(cfg)] = jax.device_get(setup.init.lower().compile(FAST)())
  return jax.device_put(_INITIAL[id(cfg)], setup.state_shardings)


# LLVM at -O0: half the compile time on CPU; every run of a comparison is compiled alike.
FAST = {"xla_backend_optimization_level": 0}


def _compiled_step(setup, batch):
  return setup.step.lower(setup.abstract_state(), batch).compile(FAST)


def _fast(fn, *args):
  """fn(*args), jitted and compiled with FAST."""
  return jax.jit(fn).lower(*args).compile(FAST)(*args)


def _trajectory(cfg, spec: str, steps: int = STEPS, init=None):
  """(loss, grad_norm, moe_dropped_frac, moe_load_imbalance) per step on mesh `spec`,
  starting from `init`'s initial state (default cfg's)."""
  setup = step.Setup(cfg, mesh_of(spec))
  it = data.batches(cfg)
  batches = [setup.device_batch(next(it)) for _ in range(steps)]
  it.close()
  compiled = _compiled_step(setup, batches[0])
  state, out = _initial(init or cfg, setup), []
  for b in batches:
    state, m = compiled(state, b)
    out.append([float(m[k]) for k in ("loss", "grad_norm", "moe_dropped_frac", "moe_load_imbalance")])
  return np.array(out), state


@pytest.fixture(scope="module")
def capacity_reference():
  return _trajectory(CAP, "dp=1")[0]


def test_reference_drops_tokens(capacity_reference):
  """The parity runs below are not trivially dropless: capacity 1.25 drops assignments."""
  assert np.all(capacity_reference[:, 2] > 0.01), capacity_reference[:, 2]
  assert capacity_reference[-1, 0] < capacity_reference[0, 0]


@pytest.mark.parametrize("spec", ["ep=4", "ep=2,fsdp=2", "ep=2,tp=2", "dp=2,ep=2", "sp=2,ep=2"])
def test_capacity_routing_matches_single_device(spec, capacity_reference):
  got = _trajectory(CAP, spec)[0]
  np.testing.assert_allclose(got[:, 0], capacity_reference[:, 0], rtol=1e-5, err_msg=f"loss on {spec}")
  np.testing.assert_allclose(got[:, 1], capacity_reference[:, 1], rtol=1e-5, err_msg=f"grad_norm on {spec}")
  np.testing.assert_array_equal(got[:, 2], capacity_reference[:, 2], err_msg=f"dropped share on {spec}")


def test_plan_decides_and_describes_the_moe_kernel():
  """The start-up line says which dispatch runs; auto picks blocks on CPU and GPU, ragged_dot on TPU."""
  assert "moe: all_to_all over expert, capacity groups of 16 tokens" in plan_lib.build(CAP, mesh_of("ep=2")).describe()
  p = plan_lib.build(DROPLESS, mesh_of("ep=2"))
  assert p.moe_kernel == "blocks" and "moe: all_to_all over expert, dropless, blocks grouped matmuls" in p.describe()
  assert plan_lib.moe_kernel(DROPLESS.model, "gpu") == "blocks"
  assert plan_lib.moe_kernel(DROPLESS.model, "tpu") == "ragged_dot"
  forced = config.load("moe-tiny", TINY + ["model.moe_dropless=true", "model.moe_grouped_matmul=ragged_dot"])
  assert plan_lib.moe_kernel(forced.model, "cpu") == "ragged_dot" and plan_lib.moe_kernel(CAP.model, "gpu") == "capacity"


def test_group_that_straddles_devices_is_a_one_line_error():
  # 1 row per device and sequence=2: the rows cannot take `sequence`, so each device holds
  # half a sequence, and a one-sequence group would straddle two devices.
  cfg = config.load("moe-tiny", ["train.batch_size=2", "train.seq_len=32"])
  with pytest.raises(UserError, match=r"model.moe_group_size=0 \(G=32 tokens\): each device holds 1 row\(s\) x 16 "
                                      r"position\(s\).*G must divide 16$"):
    moe_layout.check(cfg, mesh_of("dp=2,sp=2"))
  moe_layout.check(config.load("moe-tiny", ["train.batch_size=2", "train.seq_len=32", "model.moe_group_size=8"]),
                   mesh_of("dp=2,sp=2"))  # a group of 8 fits in 16 positions


# ---- dropless --------------------------------------------------------------------------

def _silu(x):
  return x / (1 + np.exp(-x))


def _moe_reference(x, router, wg, wu, wd, top_k, sigmoid=False, bias=None):
  """Every token through its top-k experts, looping in numpy (no capacity, no buffers)."""
  x, router, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, router, wg, wu, wd))
  logits = x @ router
  if sigmoid:
    scores = 1 / (1 + np.exp(-logits))
  else:
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
  pick = scores + (0 if bias is None else np.asarray(bias, np.float64))
  out = np.zeros_like(x)
  for idx in np.ndindex(*x.shape[:-1]):
    chosen = np.argsort(-pick[idx], kind="stable")[:top_k]
    w = scores[idx][chosen] / scores[idx][chosen].sum()
    for e, we in zip(chosen, w):
      out[idx] += we * ((_silu(x[idx] @ wg[e]) * (x[idx] @ wu[e])) @ wd[e])
  return out


def _weights(rng, D, X, F):
  return [jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)
          for s, sc in [((D, X), 1.0), ((X, D, F), 0.3), ((X, D, F), 0.3), ((X, F, D), 0.3)]]


def _dropless_layer(spec, kernel):
  """The dropless layer as the plan for (moe-tiny with 8 experts, dropless) on `spec` runs it, kernel forced."""
  cfg = config.load("moe-tiny", ["model.moe_experts=8", "model.moe_dropless=true"])
  plan = plan_lib.local(cfg) if spec is None else plan_lib.build(cfg, mesh_of(spec))
  plan = dataclasses.replace(plan, moe_kernel=kernel)

  def run(*args):
    return moe_ffn(*args, top_k=2, capacity_factor=1.0, plan=plan, dropless=True)[0]
  return run


def _dense_jnp(x, router, wg, wu, wd):
  """Differentiable plain reference: every expert on every token, weighted by the routing
  weights of the chosen experts (0 elsewhere)."""
  idx, w, _ = moe.route(x, router, 2)
  gate = jnp.sum(jax.nn.one_hot(idx, router.shape[1]) * w[..., None], axis=-2)  # (B, L, X)
  h = jax.nn.silu(jnp.einsum("bld,xdf->blxf", x, wg)) * jnp.einsum("bld,xdf->blxf", x, wu)
  return jnp.einsum("blxf,xfd,blx->bld", h, wd, gate)


@pytest.fixture(scope="module")
def layer_inputs():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 6, 16)), jnp.float32)
  return x, *_weights(rng, 16, 8, 12)


@pytest.fixture(scope="module")
def layer_reference(layer_inputs):
  """The numpy loop's output, and the plain jnp reference's gradients of <y, ct>."""
  ct = jnp.asarray(np.random.default_rng(1).standard_normal(layer_inputs[0].shape), jnp.float32)
  grads = _fast(jax.grad(lambda *a: jnp.sum(_dense_jnp(*a) * ct), argnums=tuple(range(5))), *layer_inputs)
  return _moe_reference(*layer_inputs, top_k=2), ct, grads


@pytest.mark.parametrize("spec,kernel", [("ep=2,fsdp=2,tp=2", "ragged_dot"), ("sp=2,ep=2", "ragged_dot"),
                                         ("ep=2", "blocks")])
def test_dropless_layer_equals_dense_reference(spec, kernel, layer_inputs, layer_reference):
  y = _fast(_dropless_layer(spec, kernel), *layer_inputs)
  np.testing.assert_allclose(y, layer_reference[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("spec,kernel", [(None, "ragged_dot"), ("ep=4", "ragged_dot"), (None, "blocks"),
                                         ("ep=4", "blocks")])
def test_dropless_layer_and_gradients_equal_reference(spec, kernel, layer_inputs, layer_reference):
  """Output and gradients through ragged_dot (or the blocks), the sort, the exchange and the
  inverse permutation, from one compiled vjp."""
  want_y, ct, want = layer_reference

  def fwd_bwd(*args):
    y, vjp = jax.vjp(_dropless_layer(spec, kernel), *args)
    return y, vjp(ct)
  y, got = _fast(fwd_bwd, *layer_inputs)
  np.testing.assert_allclose(y, want_y, rtol=1e-4, atol=1e-5)
  for name, g, r in zip(("x", "router", "w_gate", "w_up", "w_down"), got, want):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def dropless_reference():
  return _trajectory(DROPLESS, "dp=1", init=CAP)[0]  # same params as CAP


@pytest.mark.parametrize("spec", ["ep=2", "ep=4"])
def test_dropless_training_equal_across_expert_parallelism(spec, dropless_reference):
  assert np.all(dropless_reference[:, 2] == 0)
  got = _trajectory(DROPLESS, spec, init=CAP)[0]
  np.testing.assert_allclose(got[:, :2], dropless_reference[:, :2], rtol=1e-5, err_msg=spec)


def _to_hf(params, m):
  """jaxtrain params -> a transformers MixtralForCausalLM state dict (torch tensors)."""
  import torch
  t = lambda a: torch.tensor(np.asarray(a, np.float32))  # noqa: E731
  D, H, K, E = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
  sd = {"model.embed_tokens.weight": t(params["embed"]), "model.norm.weight": t(params["final_norm"]["scale"]),
        "lm_head.weight": t(params["lm_head"]).T}
  for i in range(m.n_layers):
    p, pre = params["layers"][i], f"model.layers.{i}."
    a, f = p["attn"], p["mlp"]
    sd.update({
        pre + "input_layernorm.weight": t(p["attn_norm"]["scale"]),
        pre + "post_attention_layernorm.weight": t(p["mlp_norm"]["scale"]),
        pre + "self_attn.q_proj.weight": t(a["wq"]).reshape(D, H * E).T,
        pre + "self_attn.k_proj.weight": t(a["wk"]).reshape(D, K * E).T,
        pre + "self_attn.v_proj.weight": t(a["wv"]).reshape(D, K * E).T,
        pre + "self_attn.o_proj.weight": t(a["wo"]).reshape(H * E, D).T,
        pre + "mlp.gate.weight": t(f["router"]).T,
        pre + "mlp.experts.gate_up_proj": torch.cat([t(f["w_gate"]), t(f["w_up"])], dim=2).transpose(1, 2),
        pre + "mlp.experts.down_proj": t(f["w_down"]).transpose(1, 2),
    })
  return sd


def test_dropless_equals_hf_mixtral_logits():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  m = config.load("moe-tiny", SHAPES + ["model.moe_dropless=true", "model.n_layers=2", "model.init_std=0.1"]).model
  net = model_lib.Transformer(m, nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(net))
  hf_cfg = transformers.MixtralConfig(
      vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff, num_hidden_layers=m.n_layers,
      num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim,
      num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k, rope_theta=m.rope_theta,
      rms_norm_eps=m.norm_eps, tie_word_embeddings=False, max_position_embeddings=64, sliding_window=None,
      attn_implementation="eager")
  hf = transformers.MixtralForCausalLM(hf_cfg).eval()
  missing, unexpected = hf.load_state_dict(_to_hf(params, m), strict=False)
  assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
  tokens = np.random.default_rng(0).integers(0, m.vocab_size, (2, 24))
  pos = np.broadcast_to(np.arange(24), (2, 24))
  ours = _fast(lambda t, p: net(t, p, jnp.ones_like(t)), jnp.asarray(tokens), jnp.asarray(pos))
  with torch.no_grad():
    theirs = hf(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)


def test_hf_aux_convention_equals_transformers_loss():
  """moe_aux_convention=hf gives transformers' load_balancing_loss_func (k times ours,
  pooled over layers); jaxtrain's is the mean of the per-layer X * sum f P."""
  pytest.importorskip("torch")
  import torch
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
  rng = np.random.default_rng(2)
  X, k = 8, 2
  xs = [jnp.asarray(rng.standard_normal((2, 5, 16)), jnp.float32) for _ in range(3)]
  routers = [jnp.asarray(rng.standard_normal((16, X)), jnp.float32) for _ in range(3)]
  stats = [moe.route(x, r, k)[2] for x, r in zip(xs, routers)]
  hf_cfg = config.load("moe-tiny", [f"model.moe_experts={X}", "model.moe_aux_weight=1", "model.moe_z_weight=0",
                                    "model.moe_aux_convention=hf"]).model
  logits = tuple(torch.tensor(np.asarray((x @ r).reshape(-1, X))) for x, r in zip(xs, routers))
  want = float(load_balancing_loss_func(logits, X, k))
  np.testing.assert_allclose(float(moe_balance.aux_loss(hf_cfg, stats)), want, rtol=1e-5)
  ours = config.load("moe-tiny", [f"model.moe_experts={X}", "model.moe_aux_weight=1", "model.moe_z_weight=0"]).model
  np.testing.assert_allclose(float(moe_balance.aux_loss(ours, stats)), np.mean([float(s["balance"]) for s in stats]),
                             rtol=1e-6)


# ---- DeepSeek-style options --------------------------------------------------------------

SMALL_DS = ["model.dtype=float32", "train.batch_size=4", "train.seq_len=16", "model.d_model=32", "model.n_heads=4",
            "model.n_kv_heads=2", "model.head_dim=8"]
DEEPSEEK = config.load("moe-deepseek-tiny", SMALL_DS)


@pytest.mark.parametrize("dropless", [True, False])
def test_shared_fine_grained_sigmoid_biased_layer_equals_reference(dropless):
  """moe-deepseek-tiny's MoE layer (16 experts of width 64 != d_ff, 1 shared, sigmoid router,
  a routing bias) against the numpy loop plus a plain SwiGLU shared expert."""
  m = DEEPSEEK.model
  layer = MoE(m, nnx.Rngs(0))
  rng = np.random.default_rng(3)
  layer.router_bias[...] = jnp.asarray(rng.standard_normal(m.moe_experts) * 0.05, jnp.float32)
  layer.router[...] = layer.router[...] * 30  # sharper scores: the bias changes some choices, not all
  x = jnp.asarray(rng.standard_normal((2, 16, m.d_model)), jnp.float32)
  if not dropless:  # capacity path, with a capacity that cannot drop
    layer.cfg = config.load("moe-deepseek-tiny", SMALL_DS + ["model.moe_dropless=false",
                                                             "model.moe_capacity_factor=0"]).model
  graphdef, state = nnx.split(layer)
  y, _ = _fast(lambda st, x: nnx.merge(graphdef, st)(x), state, x)
  assert layer.w_gate.shape == (16, m.d_model, 64) and layer.shared.w_gate.shape == (m.d_model, 64)
  s = layer.shared
  shared = (_silu(np.asarray(x) @ np.asarray(s.w_gate[...])) * (np.asarray(x) @ np.asarray(s.w_up[...]))) @ np.asarray(
      s.w_down[...])
  routed = _moe_reference(x, layer.router[...], layer.w_gate[...], layer.w_up[...], layer.w_down[...], m.moe_top_k,
                          sigmoid=True, bias=layer.router_bias[...])
  unbiased = _moe_reference(x, layer.router[...], layer.w_gate[...], layer.w_up[...], layer.w_down[...], m.moe_top_k,
                            sigmoid=True)
  assert np.abs(routed - unbiased).max() > 1e-3  # the bias did change the selection
  np.testing.assert_allclose(y, routed + shared, rtol=1e-4, atol=1e-5)


def test_first_dense_layers_and_parameter_count():
  m = DEEPSEEK.model
  net = nnx.eval_shape(lambda: model_lib.Transformer(m, nnx.Rngs(0)))
  kinds = [type(b.mlp).__name__ for b in net.layers]
  assert kinds == ["MLP", "MoE", "MoE"]
  D, V, F, Fe, X = m.d_model, m.vocab_size, m.d_ff, m.moe_expert_d_ff, m.moe_experts
  attn = D * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads) + 2 * D
  moe_layer = D * X + X + 3 * X * D * Fe + 3 * D * Fe  # router, bias, routed, one shared expert
  want = 2 * V * D + D + 3 * attn + 3 * D * F + 2 * moe_layer
  assert model_lib.param_count(nnx.state(net)) == want
  # The dense layer computes a plain SwiGLU MLP of width d_ff.
  x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 3, D)), jnp.float32)
  mlp = MLP(m, nnx.Rngs(0))  # what layer 0 is
  np.testing.assert_allclose(mlp(x), (_silu(np.asarray(x @ mlp.w_gate[...])) * np.asarray(x @ mlp.w_up[...]))
                             @ np.asarray(mlp.w_down[...]), rtol=1e-5, atol=1e-6)


def _skew(setup, state):
  """Make every MoE layer route (nearly) every token to expert 0: a head start of 0.2 on
  its routing score, where the sigmoid scores of a fresh router differ by about 0.01."""
  params = jax.tree.map(np.array, jax.device_get(state["params"]))
  for i in moe_balance.moe_layers(DEEPSEEK.model):
    params["layers"][i]["mlp"]["router_bias"][0] = 0.2
  return {**state, "params": jax.device_put(params, setup.state_shardings["params"])}


BIAS_RATE = 0.05
BIAS_CFG = config.load("moe-deepseek-tiny", SMALL_DS + [f"model.moe_bias_rate={BIAS_RATE}", "optim.lr=1e-6"])


@pytest.fixture(scope="module")
def bias_run(tmp_path_factory):
  """moe-deepseek-tiny with the aux-free bias on one device (tests/parallel/test_pipeline.py runs the
  bias on pp=2,ep=2 against one device), from a skewed router, one compiled
  step: 4 steps straight; steps 3-4 again from the state saved and restored at step 2;
  and one step on a batch without valid tokens (skipped by guarded_update)."""
  setup = step.Setup(BIAS_CFG, mesh_of("dp=1"))
  it = data.batches(BIAS_CFG)
  batches = [setup.device_batch(next(it)) for _ in range(4)]
  it.close()
  compiled = _compiled_step(setup, batches[0])
  keys = ("loss", "grad_norm", "moe_dropped_frac", "moe_load_imbalance")

  def steps(state, bs):
    out = []
    for b in bs:
      state, m = compiled(state, b)
      out.append([float(m[k]) for k in keys])
    return state, np.array(out)
  state2, first = steps(_skew(setup, _initial(BIAS_CFG, setup)), batches[:2])
  ck = checkpoint.Checkpoints(tmp_path_factory.mktemp("bias") / "checkpoints", 3, 0, False)
  ck.save(2, state2, {})
  ck.wait()
  restored, _ = ck.restore(ck.dir / "2", setup.abstract_state())
  ck.close()
  saved_bias = [np.asarray(state2["params"]["layers"][i]["mlp"]["router_bias"]) for i in (1, 2)]
  straight_state, straight = steps(state2, batches[2:])  # donates state2
  resumed_state, resumed = steps(restored, batches[2:])
  empty = {**batches[0], "loss_mask": jnp.zeros_like(batches[0]["loss_mask"])}
  skipped_state, skipped_m = compiled(jax.tree.map(jnp.copy, straight_state), empty)
  return {"metrics": np.concatenate([first, straight]), "resumed": resumed, "saved_bias": saved_bias,
          "state": straight_state, "resumed_state": resumed_state,
          "skipped": (skipped_state, bool(skipped_m["skipped"]))}


def _biases(state):
  return [np.asarray(state["params"]["layers"][i]["mlp"]["router_bias"]) for i in moe_balance.moe_layers(BIAS_CFG.model)]


def test_aux_free_bias_moves_toward_balance(bias_run):
  got = bias_run["metrics"]
  for bias in _biases(bias_run["state"]):
    moves = (bias - np.eye(len(bias))[0] * 0.2) / BIAS_RATE  # each step moves a bias by +-rate (0 at mean load)
    np.testing.assert_allclose(moves, np.round(moves), atol=1e-4)
    assert np.abs(moves).max() <= 4 + 1e-4, moves
    assert moves[0] < -1.5 and moves[0] == moves.min(), moves  # expert 0, overloaded, was pushed down
  # Step 1: every token on expert 0, max/mean load = X/k = 4. Once the 0.2 head start is used
  # up (two moves of 2 * rate), the load spreads.
  assert got[0, 3] == 4 and np.all(got[2:, 3] < 4 - 0.1), got[:, 3]


def test_aux_free_bias_restored_exactly_on_resume(bias_run):
  """Steps 3-4 from the checkpoint of step 2 equal the uninterrupted steps 3-4, and the bias
  is restored and ends bit for bit the same."""
  np.testing.assert_array_equal(bias_run["resumed"], bias_run["metrics"][2:])
  assert np.any(bias_run["saved_bias"][0] != 0)
  for a, b in zip(_biases(bias_run["state"]), _biases(bias_run["resumed_state"])):
    np.testing.assert_array_equal(a, b)


def test_skipped_step_moves_no_bias(bias_run):
  """A step that guarded_update skips (no valid token) leaves the bias and the step count as they were."""
  state, skipped = bias_run["skipped"]
  assert skipped and int(state["step"]) == int(bias_run["state"]["step"]) == 4
  for a, b in zip(_biases(state), _biases(bias_run["state"])):
    np.testing.assert_array_equal(a, b)


# ---- traffic ------------------------------------------------------------------------------

def test_inspect_moe_traffic_follows_the_dispatch():
  """moe-tiny on ep=4 (bf16, 2 MoE layers, batch 16 x 128): 4 rows x 128 = 512 tokens per
  device. Capacity: 4 groups of 128, C = ceil(1.25 * 128 * 2 / 4) = 80, buffer 4 x 4 x 80
  rows. Dropless: bound 512 x min(2, 4/4) = 512 rows to each of 4 devices."""
  from jaxtrain.analysis import comms
  ring, D, s, layers = 3 / 4, 128, 2, 2
  cap = comms.moe_traffic(config.load("moe-tiny"), mesh_of("ep=4"))["expert"]
  assert cap == {"MoE all-to-all, capacity buffers (4 per MoE layer, 1280 rows)": int(layers * 4 * ring * 1280 * D * s)}
  drop = comms.moe_traffic(config.load("moe-tiny", ["model.moe_dropless=true"]), mesh_of("ep=4"))["expert"]
  assert drop == {"MoE all-to-all, dropless exchange (4 per MoE layer, 2048 rows)": int(layers * 4 * ring * 2048 * D * s),
                  "MoE dropless expert ids": int(layers * ring * 2048 * 4)}
  # sp=2,ep=2: 8 rows over data*fsdp*expert*sequence = 4 ways, so each device holds 2 whole
  # sequences (256 tokens) and the layer reshards its input and output over `sequence`.
  seq = comms.moe_traffic(config.load("moe-tiny", ["train.batch_size=8"]), mesh_of("sp=2,ep=2"))["sequence"]
  assert seq == {"MoE reshard to whole sequences (fwd+bwd)": int(layers * 4 * 1 / 2 * 256 * D * s)}
  assert comms.moe_traffic(config.load("tiny"), mesh_of("ep=4")) == {}


def test_flops_count_routed_and_shared_experts_of_their_width():
  from jaxtrain.model import flops
  m = DEEPSEEK.model
  _, state = model_lib.abstract(m)
  D, Fe, X = m.d_model, m.moe_expert_d_ff, m.moe_experts
  norms_bias_lookup = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(state)
                          if any(n in jax.tree_util.keystr(path) for n in ("norm", "router_bias", "'embed'")))
  idle = (X - m.moe_top_k) * 3 * D * Fe  # per MoE layer: the routed experts a token does not visit
  assert flops.matmul_params(m) == model_lib.param_count(state) - norms_bias_lookup - 2 * idle


def test_bench_compare_alternates_variants_with_compiled_memory(tmp_path, capsys):
  """`python -m jaxtrain.bench --compare ...` as bench.main runs it (in-process): two variants,
  2 rounds of 2 timed steps each, compiled memory per device, the JSON and the table."""
  from jaxtrain import bench
  from jaxtrain.analysis import compare as bench_compare
  with pytest.raises(UserError, match="must look like NAME"):
    bench_compare.parse(["model.moe_dropless=true"])
  variants = ["drop:model.moe_dropless=true", "cap:model.moe_capacity_factor=1.25"]
  assert bench_compare.parse(variants) == [("drop", ["model.moe_dropless=true"]),
                                           ("cap", ["model.moe_capacity_factor=1.25"])]
  sets = [a for s in SHAPES + ["model.n_layers=1", "train.batch_size=2", "train.seq_len=16"] for a in ("--set", s)]
  args = ["--config", "moe-tiny", *sets, "--mesh", "dp=1", "--steps", "2", "--warmup", "0", "--rounds", "2",
          "--out", str(tmp_path / "bench.json")] + [a for v in variants for a in ("--compare", v)]
  # bench.main's --compare branch after its start-up (whose mesh must use every device)
  ns, mesh, out = bench.parse_args(args), mesh_of("dp=1"), tmp_path / "bench.json"
  with pytest.raises(UserError, match="--compare and --baseline do not mix"):
    bench._compare(ns, mesh, out, ["minimal"])
  assert bench._compare(ns, mesh, out, []) == 0
  rep = json.loads((tmp_path / "bench.json").read_text())
  for name in ("drop", "cap"):
    v = rep["variants"][name]
    assert v["step_time_s"]["n"] == 4 and len(v["round_medians_s"]) == 2
    assert v["compiled_memory_per_device"]["temp_bytes"] > 0
  assert "drop" in capsys.readouterr().out
