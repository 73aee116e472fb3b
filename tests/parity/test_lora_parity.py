"""LoRA (model.lora_rank) against the single-device run: loss and grad_norm at every step on sharded meshes, with
scanned layers and ZeRO; only the adapters move; the frozen base keeps no master, gradient or moments; resume."""

import json

import jax
import numpy as np
import pytest

from jaxtrain.analysis import memory
from jaxtrain.core import config
from jaxtrain.run import loop, step
from tests.helpers import mesh_of, trajectory

pytestmark = pytest.mark.slow  # compiles of whole steps: left out of -m 'not slow'

STEPS = 3
LORA = ["model.lora_rank=4", "model.lora_alpha=8", "model.lora_targets=q,k,v,o,gate,up,down", "optim.lr=3e-2"]
CFG = config.load("tiny", ["model.dtype=float32", "train.microbatches=2", *LORA])


@pytest.fixture(scope="module")
def reference():
  return trajectory(CFG, "dp=1", STEPS)


@pytest.mark.parametrize("spec,sets", [("fsdp=4", []), ("tp=4", []), ("dp=2,tp=2", []),
                                       ("fsdp=2,tp=2", ["model.scan_layers=true"]),
                                       ("dp=2,fsdp=2", ["optim.zero_stage=2"]), ("sp=2,dp=2", [])])
def test_lora_sharded_matches_single_device(spec, sets, reference):
  got = trajectory(config.load("tiny", ["model.dtype=float32", "train.microbatches=2", *LORA, *sets]), spec, STEPS)
  assert got[-1, 0] < got[0, 0]  # it trains
  np.testing.assert_allclose(got[:, 0], reference[:, 0], rtol=1e-5, err_msg=f"loss on {spec} {sets}")
  np.testing.assert_allclose(got[:, 1], reference[:, 1], rtol=1e-5, err_msg=f"grad_norm on {spec} {sets}")


# MoE (4 experts and a shared one, every expert adapted) and MLA (every projection adapted), tiny and float32
FAMILIES = {
    "moe": ["model.d_model=32", "model.n_heads=4", "model.head_dim=8", "model.d_ff=64", "model.n_layers=2",
            "model.moe_experts=4", "model.moe_top_k=2", "model.moe_expert_d_ff=16", "model.moe_shared_experts=1",
            "model.moe_first_dense=1"],
    "mla": ["model.d_model=32", "model.n_heads=4", "model.d_ff=64", "model.n_layers=2", "model.attention_type=mla",
            "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
            "model.v_head_dim=8", "model.lora_targets=q_a,q_b,kv_a,kv_b,o,gate,up,down"],
}


@pytest.mark.parametrize("family,spec,sets", [("moe", "ep=2", []), ("moe", "fsdp=2,ep=2", ["model.scan_layers=true"]),
                                              ("mla", "tp=2", []), ("mla", "fsdp=2", ["model.scan_layers=true"])])
def test_lora_on_moe_and_mla_matches_single_device(family, spec, sets):
  """Expert adapters merged into each expert's weight before the dispatch over `expert`; MLA's adapters with heads
  split: 2 steps equal one device's."""
  base = ["model.dtype=float32", "train.microbatches=2", *LORA, *FAMILIES[family]]
  want = trajectory(config.load("tiny", base), "dp=1", 2)
  got = trajectory(config.load("tiny", [*base, *sets]), spec, 2)
  np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=1e-5, err_msg=f"loss on {family} {spec} {sets}")
  np.testing.assert_allclose(got[:, 1], want[:, 1], rtol=1e-5, err_msg=f"grad_norm on {family} {spec} {sets}")


def test_moe_adapters_alone_train_and_keep_optimizer_state():
  """On an expert mesh, the experts' adapters (A (X, D, r) on the experts' sharding) have moments, the expert
  weights none, and stay bit-identical."""
  from jaxtrain import data
  cfg = config.load("tiny", [*LORA, *FAMILIES["moe"], "model.lora_targets=gate,down"])
  setup = step.Setup(cfg, mesh_of("fsdp=2,ep=2"))
  state = setup.init()
  before = {k: np.asarray(x) for k, x in _leaves(state["params"]).items()}
  it = data.batches(cfg)
  state, _ = setup.step(state, setup.device_batch(next(it)))
  it.close()
  after = _leaves(state["params"])
  mu = {k.replace("']['", "/") for k in _leaves(state["opt"][0].mu)}
  assert mu == {k.replace("']['", "/") for k in after if "_lora" in k}
  assert any("['mlp']['w_gate_lora']" in k for k in after) and any("['shared']['w_down_lora']" in k for k in after)
  for k, x in after.items():
    if "_lora" not in k:
      np.testing.assert_array_equal(np.asarray(x), before[k], err_msg=k)
  moe = state["params"]["layers"][1]["mlp"]
  assert moe["w_gate_lora"]["lora_a"].sharding.spec[0] == moe["w_gate"].sharding.spec[0] == "expert"


def _leaves(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_only_adapters_train_and_the_base_keeps_no_optimizer_state():
  """Default bfloat16 compute: the base is stored in bfloat16 and bit-identical after training, every adapter has
  moments and nothing else has; the adapters sit on their base weight's shardings."""
  from jaxtrain import data
  cfg = config.load("tiny", [*LORA, "model.lora_targets=q,o,down"])
  setup = step.Setup(cfg, mesh_of("fsdp=2,tp=2"))
  state = setup.init()
  before = {k: np.asarray(x) for k, x in _leaves(state["params"]).items()}
  it = data.batches(cfg)
  for _ in range(2):
    state, _ = setup.step(state, setup.device_batch(next(it)))
  it.close()
  after = _leaves(state["params"])
  adapters = {k for k in after if "_lora" in k}
  assert len(adapters) == 2 * 3 * cfg.model.n_layers  # A and B of q, o, down in every layer
  for k, x in after.items():
    if k in adapters:
      assert x.dtype == np.float32
    else:
      assert x.dtype == (np.float32 if "scale" in k else jax.numpy.bfloat16), k
      np.testing.assert_array_equal(np.asarray(x), before[k], err_msg=k)
  assert any(not np.array_equal(np.asarray(after[k]), before[k]) for k in adapters if "lora_b" in k)
  mu = _leaves(state["opt"][0].mu)
  assert {k.replace("']['", "/") for k in mu} == {k.replace("']['", "/") for k in adapters}
  wq, a, b = (state["params"]["layers"][0]["attn"][k] for k in ("wq", "wq_lora", "wq_lora"))
  assert a["lora_a"].sharding.spec[0] == wq.sharding.spec[0] == "fsdp"  # A (embed, r): like wq's input
  assert tuple(b["lora_b"].sharding.spec)[1:] == tuple(wq.sharding.spec)[1:]  # B (r, heads, head_dim): its output


def test_bill_has_no_master_or_moments_for_the_base():
  """The bill's state, from the real state's shapes: float32 moments for the adapters alone (r=4: 2048 r per layer
  over q, k, v, o, gate, up, down), the base's matrices in bfloat16 (norm scales float32), no moments for it."""
  cfg = config.load("tiny", LORA)
  full, lora = (memory.state_bytes(step.Setup(c, mesh_of("fsdp=1"))) for c in (config.load("tiny"), cfg))
  adapters, norms, base = 2048 * 4 * cfg.model.n_layers, 128 * (2 * cfg.model.n_layers + 1), 426_624
  assert lora["adam_m"] == lora["adam_v"] == 4 * adapters
  assert full["adam_m"] == 4 * base
  assert lora["params"] == 2 * (base - norms) + 4 * norms + 4 * adapters
  setup = step.Setup(cfg, mesh_of("fsdp=1"))
  assert setup.n_params == base + adapters
  assert memory.step_bytes(setup)["gradients"] == 4 * adapters  # a gradient for the adapters alone
  dtypes = {r.path: r.dtype for r in memory.param_rows(setup, stored=True)}  # inspect's parameter table
  assert dtypes["layers/0/attn/wq"] == dtypes["embed"] == "bfloat16" and dtypes["layers/0/attn_norm/scale"] == "float32"
  assert dtypes["layers/0/attn/wq_lora/lora_a"] == dtypes["layers/0/mlp/w_down_lora/lora_b"] == "float32"


def _losses(workdir):
  records = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
  return [(r["step"], r["loss"], r["grad_norm"]) for r in records]


def test_lora_resume_is_exact(tmp_path):
  cfg = config.load("tiny", [*LORA, "train.batch_size=4", "train.seq_len=32", "data.workers=0",
                             "checkpoint.async_save=false"])
  loop.run(cfg, mesh_of("fsdp=2"), tmp_path / "once", "m", stop_at=4)
  loop.run(cfg, mesh_of("fsdp=2"), tmp_path / "twice", "m", stop_at=2)
  loop.run(cfg, mesh_of("fsdp=2"), tmp_path / "twice", "m", stop_at=4)
  once, twice = _losses(tmp_path / "once"), _losses(tmp_path / "twice")
  assert [s for s, *_ in twice] == [1, 2, 3, 4] and twice == once


def test_lora_on_a_pipeline_mesh_is_refused_in_one_line():
  from jaxtrain.core.errors import UserError
  with pytest.raises(UserError) as e:
    step.Setup(config.load("tiny", LORA), mesh_of("pp=2"))
  assert "model.lora_rank=4 with mesh pipeline=2 is not supported yet" in str(e.value)
  assert "\n" not in str(e.value)
