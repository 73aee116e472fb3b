"""Ulysses sequence parallelism (model.sequence_attention=ulysses) against one device, in the compiled
program (all-to-alls, no gathered K/V) and in the analytic traffic, plus the refused head splits."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.analysis import comms, gpu_compile, memory
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import kernels
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.run import step
from tests.helpers import mesh_of, needs_plugin, trajectory

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

# tiny in float32 with 2 KV heads for 8 query heads, on rows of 128 tokens that pack 1-3 documents each (boundaries
# off the shard edges); scanned layers compile once.
SETS = ["model.dtype=float32", "model.n_kv_heads=2", "model.scan_layers=true", "train.batch_size=8",
        "train.seq_len=128", "model.sequence_attention=ulysses"]
CFG = config.load("tiny", SETS)


def test_batches_hold_packed_documents():
  it = data.batches(CFG)
  seg = next(it)["segment_ids"]
  it.close()
  assert kernels.segments_per_row(seg).max() > 1


@pytest.fixture(scope="module")
def reference():
  return trajectory(CFG, "dp=1", 3)


# sp=4 and tp=2,sp=2 split the heads 4 ways: the 2 KV heads are repeated x2 (GQA, fewer KV heads than the degree).
@pytest.mark.parametrize("spec", ["sp=2", "sp=4", "fsdp=2,tp=2,sp=2"])
def test_ulysses_matches_one_device(spec, reference):
  assert plan_lib.build(CFG, mesh_of(spec)).ulysses
  got = trajectory(CFG, spec, 3)
  assert got[-1, 0] < got[0, 0]
  np.testing.assert_allclose(got[:, 0], reference[:, 0], rtol=1e-5, err_msg=f"loss on {spec}")
  np.testing.assert_allclose(got[:, 1], reference[:, 1], rtol=1e-5, err_msg=f"grad_norm on {spec}")


def _compiled(spec, sets=()):
  cfg = config.load("tiny", [*SETS, *sets])
  setup = step.Setup(cfg, mesh_of(spec))
  batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), jnp.int32, sharding=setup.batch_sharding)
           for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
  text = setup.step.lower(jax.eval_shape(setup.init), batch).compile().as_text()
  return setup, gpu_compile.Hlo.parse(text)


def test_compiled_step_moves_heads_by_all_to_all_and_matches_the_traffic_figure():
  setup, hlo = _compiled("tp=2,sp=2")  # heads over tensor x sequence, KV heads repeated
  m, L, sp = setup.cfg.model, setup.cfg.train.seq_len, 2
  counted = gpu_compile.collectives(hlo)
  # q, k, v and the output forward, their gradients backward: 8 all-to-alls per layer
  assert counted["all-to-all"]["per_step"] == 8 * m.n_layers, counted["all-to-all"]
  # Nothing gathers K or V over the whole sequence (any head count, any batch split).
  gathered = [i.shape for i in hlo.instrs if i.opcode.startswith("all-gather") and "f32" in i.shape]
  assert not [s for s in gathered if re.search(rf"f32\[\d+,{L},\d+,{m.head_dim}\]", s)], gathered
  # The analytic figure is (n-1)/n of what the compiled all-to-alls hold.
  rows = memory.grouped(memory.param_rows(setup))
  figure = comms.traffic(setup.cfg, setup.mesh, rows)["sequence"]
  assert figure[next(k for k in figure if k.startswith("ulysses"))] == int(
      counted["all-to-all"]["bytes_per_step"] * (sp - 1) / sp)
  # The segment ids (int32) are the one gather: the kernel masks whole sequences.
  assert figure["segment ids all-gather"] == int(counted["all-gather"]["bytes_per_step"] * (sp - 1) / sp), figure


def test_head_split_that_cannot_work_is_one_line_naming_the_heads():
  with pytest.raises(UserError) as e:
    plan_lib.build(config.load("tiny", [*SETS, "model.n_heads=4", "model.n_kv_heads=2"]), mesh_of("sp=8"))
  msg = str(e.value)
  assert "\n" not in msg and "model.n_heads=4" in msg and "n_kv_heads=2" in msg and "sequence=8" in msg, msg
  # tensor takes its share of the heads first: 4 heads split over sequence=4, not over sequence=4 x tensor=2
  assert plan_lib.build(config.load("tiny", [*SETS, "model.n_heads=4", "model.n_kv_heads=2"]), mesh_of("sp=4")).ulysses
  with pytest.raises(UserError, match=r"sequence=4 x tensor=2, but model.n_heads=4 \(n_kv_heads=2\) is not a multiple "
                     "of 8"):
    plan_lib.build(config.load("tiny", [*SETS, "model.n_heads=4", "model.n_kv_heads=2"]), mesh_of("tp=2,sp=4"))


def test_cudnn_runs_inside_ulysses_on_a_gpu_target():
  sets = ["model.dtype=bfloat16", "train.seq_len=128", "model.attention=cudnn"]
  mesh = mesh_of("sp=4")
  ulysses = plan_lib.build(config.load("tiny", [*sets, "model.sequence_attention=ulysses"]), mesh, device="H100")
  assert (ulysses.attention, ulysses.ulysses) == ("cudnn", True) and "ulysses" in ulysses.describe()
  ring = plan_lib.build(config.load("tiny", sets), mesh, device="H100")  # the ring calls cuDNN on its block pairs
  assert (ring.attention, ring.ring_kernel, ring.ulysses) == ("ring", "cudnn", False), ring.describe()
  with pytest.raises(UserError, match="ring attention computes its own blocks, and cannot call cuDNN on them here "
                     r"\(sliding windows\)"):
    plan_lib.build(config.load("tiny", [*sets, "model.sliding_window=16"]), mesh, device="H100")


@needs_plugin
def test_compiles_for_h100s_with_cudnn_inside_ulysses():
  """tiny in bfloat16 on 8 compile-only H100s, sequence=8, remat save_dots: cuDNN runs on whole sequences of one
  head per device, and the all-to-alls (the forward ones again in the recomputation) match the figure."""
  cfg = config.load("tiny", ["model.sequence_attention=ulysses", "model.remat=save_dots", "model.scan_layers=true",
                             "train.batch_size=2", "train.seq_len=256", "model.attention_max_segments=8"])
  setup = step.Setup(cfg, gpu_compile.mesh("H100", "sp=8"))
  assert setup.plan.attention == "cudnn" and setup.plan.ulysses
  compiled, _ = gpu_compile.compile_step(setup)
  hlo = gpu_compile.Hlo.parse(compiled.as_text())
  assert gpu_compile.cudnn_attention_calls(hlo)["per_step"] >= 2 * cfg.model.n_layers  # forward and backward
  counted = gpu_compile.collectives(hlo)
  figure = comms.traffic(cfg, setup.mesh, memory.grouped(memory.param_rows(setup)))["sequence"]
  assert figure["ulysses all-to-all q/k/v/out (fwd+bwd)"] == int(counted["all-to-all"]["bytes_per_step"] * 7 / 8)
  assert counted["all-gather"]["bytes_per_step"] == 2 * 256 * 4  # the segment ids, nothing else


@pytest.mark.parametrize("spec", ["sp=2,tp=2", "pp=2,dp=2"])
def test_mla_through_the_cudnn_path_equals_one_device(spec, monkeypatch):
  """MLA's narrower v padded for cuDNN, under Ulysses and inside the pipeline's region, run on CPU with the cuDNN
  kernel's XLA implementation in its place (the same call, masks and padding): the losses equal one device with
  the reference kernel, float32."""
  fused = kernels.fused
  monkeypatch.setattr(kernels, "fused", lambda q, k, v, seg, **kw: fused(q, k, v, seg, implementation="xla", **kw))
  cfg = config.load("deepseek-v3-tiny", ["model.n_layers=2", "model.moe_first_dense=0", "model.dtype=float32",
                                         "train.batch_size=4", "train.seq_len=16", "train.microbatches=2",
                                         "model.sequence_attention=ulysses", "model.scan_layers=true",
                                         "model.d_model=32", "model.n_heads=4", "model.moe_experts=4",
                                         "model.moe_n_group=1", "model.moe_topk_group=1", "model.moe_top_k=2",
                                         "model.moe_expert_d_ff=16", "model.d_ff=64"])
  ref = trajectory(cfg, "dp=1", 2)
  real = plan_lib.build

  def cudnn_plan(c, mesh, device=None, segments=None):  # what an H100 decides
    return dataclasses.replace(real(c, mesh, device, segments), attention="cudnn")
  monkeypatch.setattr(plan_lib, "build", cudnn_plan)
  got = trajectory(cfg, spec, 2)
  np.testing.assert_allclose(got, ref, rtol=1e-5)
