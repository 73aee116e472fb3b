"""Analytic traffic per mesh axis against hand computations for `tiny` (426,624 params,
640 of them in norm scales; 2 layers, d_model 128, 4 KV heads of 16, batch 16 x 128, bf16)."""

import math

from jaxtrain.analysis import comms, gpu_compile
from jaxtrain.core import config
from jaxtrain.analysis import memory
from jaxtrain.run import step
from tests.helpers import mesh_of, needs_plugin


def _traffic(spec, sets=()):
  setup = step.Setup(config.load("tiny", list(sets)), mesh_of(spec))
  return comms.traffic(setup.cfg, setup.mesh, memory.grouped(memory.param_rows(setup)))


def test_data_parallel_all_reduces_every_gradient():
  # ring all-reduce of 426,624 float32 gradients over 4 devices: 2 x 3/4 x 4 bytes each (XLA:CPU: all float32)
  assert _traffic("dp=4") == {"data": {"grad all-reduce": 2 * 3 * 426_624}}
  # Microbatches: still one reduction per update over data (fsdp's reduce-scatter runs per microbatch: below).
  assert _traffic("dp=4", ["train.microbatches=4"]) == _traffic("dp=4")


@needs_plugin
def test_data_parallel_reduces_matmul_gradients_in_bfloat16_on_h100s():
  # the 65,536-entry embedding table and 640 norm scales in float32, the 360,448 matmul weights (lm_head too) in
  # bfloat16, the model's dtype (data_region.wire_dtype)
  setup = step.Setup(config.load("tiny"), gpu_compile.mesh("H100", "dp=4"))
  got = comms.traffic(setup.cfg, setup.mesh, memory.grouped(memory.param_rows(setup)))
  assert got == {"data": {"grad all-reduce": int(2 * 3 / 4 * ((65_536 + 640) * 4 + 360_448 * 2))}}


def test_fsdp_gathers_weights_twice_and_reduce_scatters_gradients():
  shard = (426_624 - 640) // 4  # elements per device of the FSDP-sharded params
  t = _traffic("fsdp=4")["fsdp"]
  assert t["param all-gather (fwd+bwd)"] == 2 * 3 * shard * 2  # bf16, forward and backward
  assert t["grad reduce-scatter"] == 3 * shard * 4
  assert t["grad all-reduce"] == int(2 * 3 / 4 * 640 * 4)  # the replicated norm scales
  # Two microbatches: every collective runs once per microbatch.
  t2 = _traffic("fsdp=4", ["train.microbatches=2"])["fsdp"]
  assert t2 == {k: 2 * v for k, v in t.items()}


def test_tensor_and_sequence_traffic():
  tokens = 16 * 128  # per device on tp=2: the batch is not split
  t = _traffic("tp=2")["tensor"]
  assert t["activation all-reduce (4 per layer)"] == 4 * 2 * tokens * 128 * 2 * (2 * 1 / 2)
  assert t["embedding + LM head all-reduce"] == tokens * 128 * (4 + 2) * (2 * 1 / 2)
  assert "grad all-reduce (weights replicated over tensor)" not in t  # 4 KV heads split 2 ways
  s = _traffic("sp=2")["sequence"]
  # K and V (4 heads x 16, bf16) of 16 x 64 local tokens, to 1 neighbour, forward + 2x backward, 2 layers
  assert s["ring K/V transfers (fwd+bwd)"] == 3 * 1 * 2 * (16 * 64) * 2 * 4 * 16 * 2



def test_a_pipeline_stage_moves_only_its_own_layers_activations():
  """Under pipeline=2 each device runs 1 of tiny's 2 layers: its tensor all-reduces are one layer's, every
  microbatch (2 of 8 rows x 128 tokens), not the whole model's (Megatron's TP4 PP8 was charged 8x); so its MoE
  all-to-alls."""
  tokens = 16 // 2 * 128  # one microbatch, not split over pipeline or tensor
  t = _traffic("pp=2,tp=2", ["train.microbatches=2"])["tensor"]
  assert t["activation all-reduce (4 per layer)"] == 2 * 4 * 1 * tokens * 128 * 2 * (2 * 1 / 2)
  # moe-tiny's 2 MoE layers: one a stage, its 4 all-to-alls of the capacity buffers each microbatch: 4 experts x 4
  # groups (8 rows of a microbatch over ep=2) x 80 slots (test_expert_parallel_moe_traffic_follows_the_capacity)
  setup = step.Setup(config.load("moe-tiny", ["train.microbatches=2"]), mesh_of("pp=2,ep=2"))
  m = comms.moe_traffic(setup.cfg, setup.mesh)["expert"]
  want = int(2 * 1 * 4 * (1 / 2) * 1280 * 128 * 2)  # microbatches x layers x all-to-alls x (n-1)/n x rows x D x bf16
  assert m == {"MoE all-to-all, capacity buffers (4 per MoE layer, 1280 rows)": want}

def test_expert_parallel_moe_traffic_follows_the_capacity():
  """moe-tiny on ep=4: 4 rows x 128 tokens per device, 4 experts, top-2, capacity 1.25 per
  group of one sequence (128 tokens): 4 groups of C = ceil(1.25 * 128 * 2 / 4) = 80 slots
  per expert (see test_moe_parity for the dropless exchange)."""
  setup = step.Setup(config.load("moe-tiny"), mesh_of("ep=4"))
  rows = memory.grouped(memory.param_rows(setup))
  t = comms.traffic(setup.cfg, setup.mesh, rows)["expert"]
  G = 128
  C = -(-5 * G * 2 // (4 * 4))  # ceil(1.25 * G * k / X)
  buffer_rows = 4 * (16 // 4 * 128 // G) * C  # X x groups x C
  want = 4 * 2 * (3 / 4) * buffer_rows * 128 * 2  # 4 all-to-alls x 2 MoE layers x (n-1)/n of the buffer, bf16
  assert t[f"MoE all-to-all, capacity buffers (4 per MoE layer, {buffer_rows} rows)"] == int(want)
  # Expert weights stay on their devices: nothing of them is gathered or reduced over `expert`. The dense
  # weights are stored split over `expert` too (FSDP-like: gathered fwd+bwd in bf16, f32 grads
  # reduce-scattered); what does not split (norm scales) has its gradient all-reduced.
  size = lambda rs: sum(math.prod(r.device_shape) * r.count for r in rs)  # noqa: E731
  split = [r for r in rows if "experts" not in r.axes and "expert" in comms._axes_of(r.spec)]
  whole = [r for r in rows if "experts" not in r.axes and "expert" not in comms._axes_of(r.spec)]
  assert size(split) > 0 and size(whole) > 0 and any("experts" in r.axes for r in rows)
  assert t["param all-gather (fwd+bwd)"] == 2 * 3 * size(split) * 2 and t["grad reduce-scatter"] == 3 * size(split) * 4
  assert t["grad all-reduce"] == int(2 * 3 / 4 * size(whole) * 4)
