"""optim.zero_stage and optim.offload change where the train state lives, never the update's math:
against one device, against the same layout without offload, and across a checkpoint."""

import collections
import functools
import re

import jax
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.run import checkpoint, runs, step
from tests.helpers import mesh_of, trajectory

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

STEPS = 2
BASE = ["model.dtype=float32", "train.microbatches=2", "train.batch_size=8", "train.seq_len=32"]


@functools.cache
def _run(spec: str, *sets: str):
  return trajectory(config.load("tiny", BASE + list(sets)), spec, STEPS)


@pytest.mark.parametrize("spec, stage", [("dp=4", 1), ("dp=2,fsdp=2", 2)])  # the rest: the pairwise matrix
def test_zero_stage_matches_single_device(spec, stage):
  got, ref = _run(spec, f"optim.zero_stage={stage}"), _run("dp=1")
  assert got[-1, 0] < got[0, 0]  # it trains
  np.testing.assert_allclose(got[:, 0], ref[:, 0], rtol=1e-5, err_msg=f"loss, zero_stage={stage} on {spec}")
  np.testing.assert_allclose(got[:, 1], ref[:, 1], rtol=1e-5, err_msg=f"grad_norm, zero_stage={stage} on {spec}")


@pytest.mark.parametrize("state_dtype", ["int8"])  # bfloat16: the pairwise matrix
def test_quantized_moments_on_a_mesh_match_single_device(state_dtype):
  """optim.state_dtype=int8 on dp=2,fsdp=2 with ZeRO-2 (master, moments and gradients split over both axes): the
  codes and block scales sharded, each block quantized where it lives, equal to the same state_dtype on one
  device."""
  sets = BASE + [f"optim.state_dtype={state_dtype}"]
  cfg = config.load("tiny", sets + ["optim.zero_stage=2"])
  assert any(x.dtype == np.uint8 for x in jax.tree.leaves(step.Setup(cfg, mesh_of("dp=2,fsdp=2")).state_shapes))
  # 3 steps: the first update uses the moments before they are stored, the second the stored ones
  got, ref = trajectory(cfg, "dp=2,fsdp=2", 3), trajectory(config.load("tiny", sets), "dp=1", 3)
  np.testing.assert_allclose(got, ref, rtol=1e-5)


@pytest.mark.parametrize("layers", ["model.scan_layers=true"])  # per-layer parameters: the matrix's offload rows
def test_offload_to_host_matches_the_same_layout_on_device(layers):
  """The update streamed a layer at a time (a slice of the stack under scan_layers) equals the whole one."""
  got = _run("dp=2,fsdp=2", "optim.zero_stage=2", "optim.offload=host", layers)
  np.testing.assert_allclose(got, _run("dp=2,fsdp=2", "optim.zero_stage=2", layers), rtol=1e-6)


@pytest.mark.parametrize("layers", ["model.scan_layers=false"])  # a stack's slices: the test above
def test_offloaded_update_moves_the_routing_bias_where_the_master_lives(layers):
  """Aux-loss-free balancing with master and moments in host memory, one device: the biases (one per MoE layer and
  the MTP block's) move as in the same run on device, bit for bit in float32 (on main: a 46-line traceback,
  "memory_space of all inputs passed to add must be the same")."""
  sets = ["model.n_layers=2", "model.moe_first_dense=0", "model.mtp_layers=1", "model.mtp_weight=0.3",
          "model.dtype=float32", "train.batch_size=4", "train.seq_len=16", "model.d_model=32", "model.n_heads=4",
          "model.moe_experts=8", "model.moe_n_group=2", "model.moe_expert_d_ff=16", "model.d_ff=64", layers]

  def biases(offload):
    cfg = config.load("deepseek-v3-tiny", [*sets, f"optim.offload={offload}"])
    setup = step.Setup(cfg, mesh_of("dp=1"))
    it = data.batches(cfg)
    state = setup.init()
    for _ in range(STEPS):
      state, m = setup.step(state, setup.device_batch(next(it)))
    it.close()
    p = jax.device_get(state["params"])
    rows = [p["mtp"]["block"]["mlp"]["router_bias"]]
    rows += [p["layers"]["mlp"]["router_bias"]] if cfg.model.scan_layers else [
        p["layers"][i]["mlp"]["router_bias"] for i in range(2)]
    return np.concatenate([np.ravel(r) for r in rows]), float(m["loss"])
  host, device = biases("host"), biases("none")
  assert np.any(host[0] != 0)  # the biases moved
  np.testing.assert_array_equal(host[0], device[0])
  np.testing.assert_allclose(host[1], device[1], rtol=1e-6)


def test_master_and_moments_live_where_the_stage_and_offload_say():
  setup = step.Setup(config.load("tiny", BASE + ["optim.zero_stage=1", "optim.offload=host"]), mesh_of("dp=2,fsdp=2"))
  state = jax.eval_shape(setup.init)
  wq = setup.state_shardings["params"]["layers"][0]["attn"]["wq"]  # (embed, heads, head_dim)
  assert wq.spec[0] == ("data", "fsdp") and wq.memory_kind == "pinned_host"
  assert setup.state_shardings["opt"][0].mu["layers"][0]["attn"]["wq"] == wq
  assert setup.param_shardings["layers"][0]["attn"]["wq"].spec[0] == "fsdp"  # computed with fsdp's layout only
  assert state["params"]["embed"].dtype == np.float32


def test_checkpoint_resumes_with_another_stage_offload_and_mesh(tmp_path):
  """Saved by zero-2 + offload on dp=2,fsdp=2; restored bit for bit into zero-0 on dp=2,fsdp=2 and zero-1 on
  dp=4, each array in the new layout and memory kind."""
  cfg = config.load("tiny", BASE + ["optim.zero_stage=2", "optim.offload=host"])
  saver = step.Setup(cfg, mesh_of("dp=2,fsdp=2"))
  it = data.batches(cfg)
  state, _ = saver.step(saver.init(), saver.device_batch(next(it)))
  it.close()
  saved = jax.device_get(state)
  ck = checkpoint.Checkpoints(tmp_path / "checkpoints", 3, 0, False)
  ck.save(1, state, {})
  ck.wait()
  for spec, sets in (("dp=2,fsdp=2", ["optim.zero_stage=0"]), ("dp=4", ["optim.zero_stage=1"])):
    setup = step.Setup(config.load("tiny", BASE + sets), mesh_of(spec))
    restored, _ = ck.restore(ck.dir / "1", setup.abstract_state())
    for got, want, sh in zip(jax.tree.leaves(restored), jax.tree.leaves(saved),
                             jax.tree.leaves(setup.state_shardings), strict=True):
      assert got.sharding == sh, (spec, got.sharding, sh)
      np.testing.assert_array_equal(np.asarray(got), want)
  ck.close()
  # generate / hf export read the parameters alone: in device memory, the compute layout
  _, params = runs.restore_params(cfg, mesh_of("dp=2,fsdp=2"), ck.dir / "1")
  wq = params["layers"][0]["attn"]["wq"]
  assert wq.sharding.memory_kind == "device" and wq.sharding.spec[0] == "fsdp"
  np.testing.assert_array_equal(np.asarray(wq), saved["params"]["layers"][0]["attn"]["wq"])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_offloaded_update_that_overflows_moves_nothing():
  """lr=1e39 (inf in float32): finite gradients, overflowing new parameters; the streamed update (the non-layer
  parameters first, then layer by layer) must still be all or nothing, as the on-device update is."""
  cfg = config.load("tiny", BASE + ["optim.offload=host", "model.scan_layers=true", "optim.lr=1e39",
                                    "optim.warmup_steps=0"])
  setup = step.Setup(cfg, mesh_of("dp=2"))
  it = data.batches(cfg)
  before = jax.device_get(setup.init())
  state, m = setup.step(setup.init(), setup.device_batch(next(it)))
  it.close()
  assert bool(m["skipped"]) and np.isfinite(float(m["grad_norm"]))
  for got, want in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(got, want)


def test_offloaded_update_brings_one_layer_of_master_and_moments_to_the_device_at_a_time():
  """The step lowered for GPU (jax.export; XLA:CPU lowers no placements): each whole scanned stack of a matmul
  weight goes to device memory in float32 once, its master for the compute copy; the update brings layer slices of master and moments
  (a whole-state fetch moves every stack three more times: master, m, v)."""
  cfg = config.load("tiny", ["model.scan_layers=true", "model.n_layers=4", "optim.offload=host",
                             "train.batch_size=4", "train.seq_len=16"])
  setup = step.Setup(cfg, mesh_of("dp=1"))
  it = data.batches(cfg)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                       setup.device_batch(next(it)))
  it.close()
  state = setup.abstract_state()
  text = jax.export.export(setup.step, platforms=["cuda"])(state, batch).mlir_module()
  moved = collections.Counter(re.findall(r'_xla_buffer_placement = "device".*: \(tensor<([0-9x]+)xf32>\)', text))
  stacks = collections.Counter("x".join(map(str, x.shape)) for x in jax.tree.leaves(state["params"]["layers"])
                               if x.ndim >= 3)  # matmul weights (norm scales go twice: fetched, then placed)
  assert {k: moved[k] for k in stacks} == stacks, moved
  assert moved["128x256"] >= 3 * 2 * 2  # w_gate, w_up slices (master, m, v) in both passes
