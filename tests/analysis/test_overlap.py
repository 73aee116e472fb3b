"""The overlap report (jaxtrain.analysis.overlap) on a CPU-compiled 8-device step: every collective of
the program listed with its async flag and bytes, the bytes equal to the analytic `comms` figures."""

import math
import re

import pytest

from jaxtrain.analysis import comms, gpu_compile, memory, overlap
from jaxtrain.core import config
from jaxtrain.run import step
from tests.helpers import mesh_of


@pytest.fixture(scope="module")
def compiled():
  """spec -> (setup, optimized HLO text, overlap report) of tiny's train step, compiled once per spec."""
  cache = {}

  def get(spec):
    if spec not in cache:
      setup = step.Setup(config.load("tiny"), mesh_of(spec))
      text = setup.step.lower(*gpu_compile.abstract_inputs(setup)).compile().as_text()
      cache[spec] = setup, text, overlap.report(gpu_compile.Hlo.parse(text))
    return cache[spec]
  return get


@pytest.mark.parametrize("spec", ["dp=8", "fsdp=8"])
def test_every_collective_is_listed_with_its_async_flag_and_bytes(compiled, spec):
  _, text, rep = compiled(spec)
  # the program's collective instructions, counted from the text alone (a -done is half of its -start)
  ops = re.findall(r"= .*? (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", text)
  assert len(rep["collectives"]) == len(ops) > 0
  assert sorted(r["kind"] for r in rep["collectives"]) == sorted(ops)
  for r in rep["collectives"]:
    assert isinstance(r["async"], bool) and r["bytes"] > 0 and r["group"] == 8, r
    assert "seconds" not in r  # no device row on CPU: bytes, no times
  assert "totals" not in rep


def test_data_parallel_gradient_all_reduce_bytes_equal_comms(compiled):
  """dp=8: the wire bytes of the gradient all-reduce (ring: 2 x 7/8 of the float32 gradients) are
  comms' 'grad all-reduce', up to the loss and token-count scalars XLA combines into the same ops."""
  setup, _, rep = compiled("dp=8")
  want = comms.traffic(setup.cfg, setup.mesh, memory.grouped(memory.param_rows(setup)))["data"]["grad all-reduce"]
  got = rep["per_kind"]["all-reduce"]["wire_bytes"]
  assert want <= got <= want + 2 * 7 / 8 * 4 * 4, (got, want)


HLO = """HloModule m

ENTRY %main (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  ROOT %d = f32[1024,1024]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_h100_prediction_is_calibrated_by_the_peers_measured_over_predicted():
  from jaxtrain.parallel import devices
  tot = overlap.report(gpu_compile.Hlo.parse(HLO), devices.TABLE["H100"])["totals"]
  assert tot["predicted_step_seconds"] > 0
  assert tot["calibrated_step_seconds"] == pytest.approx(tot["predicted_step_seconds"] * 0.721 / 0.608)
  assert "calibrated_step_seconds" not in overlap.report(gpu_compile.Hlo.parse(HLO), devices.TABLE["A100"])["totals"]


@pytest.mark.slow  # a compile of a whole step
def test_lora_reduces_the_adapters_gradients_alone():
  """LoRA on dp=8: the frozen base has no gradient, so the compiled program's all-reduce carries the adapters'
  alone, and comms bills that (it billed every parameter's gradient before)."""
  setup = step.Setup(config.load("tiny", ["model.lora_rank=4", "model.lora_targets=q,k,v,o"]), mesh_of("dp=8"))
  rep = overlap.report(gpu_compile.Hlo.parse(setup.step.lower(*gpu_compile.abstract_inputs(setup)).compile().as_text()))
  rows = memory.grouped(memory.param_rows(setup))
  want = comms.traffic(setup.cfg, setup.mesh, rows)["data"]["grad all-reduce"]
  adapters = sum(math.prod(r.device_shape) * r.count for r in rows if not r.role.frozen)
  assert want == int(2 * 7 / 8 * adapters * 4) > 0
  got = rep["per_kind"]["all-reduce"]["wire_bytes"]
  assert want <= got <= want + 2 * 7 / 8 * 4 * 4, (got, want)


LOOPED = """HloModule m

%idle (a: f32[1024,1024]) -> f32[1024,1024] {
  ROOT %a = f32[1024,1024]{1,0} parameter(0)
}

%work (w: f32[1024,1024]) -> f32[1024,1024] {
  %w = f32[1024,1024]{1,0} parameter(0)
  ROOT %d = f32[1024,1024]{1,0} dot(%w, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%idle2 (a2: f32[1024,1024]) -> f32[1024,1024] {
  ROOT %a2 = f32[1024,1024]{1,0} parameter(0)
}

%work2 (w2: f32[1024,1024]) -> f32[1024,1024] {
  %w2 = f32[1024,1024]{1,0} parameter(0)
  ROOT %d2 = f32[1024,1024]{1,0} dot(%w2, %w2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond (cp: (s32[], f32[1024,1024])) -> pred[] {
  %cp = (s32[], f32[1024,1024]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%body (bp: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %bp = (s32[], f32[1024,1024]) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %x = f32[1024,1024]{1,0} get-tuple-element(%bp), index=1
  %c = f32[1024,1024]{1,0} conditional(%i, %x, %x), branch_computations={%idle, %work}
  %pr = pred[] constant(true)
  %c2 = f32[1024,1024]{1,0} conditional(%pr, %c, %c), true_computation=%work2, false_computation=%idle2
  ROOT %t = (s32[], f32[1024,1024]) tuple(%i, %c2)
}

ENTRY %main (p: f32[1024,1024]) -> (s32[], f32[1024,1024]) {
  %p = f32[1024,1024]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[1024,1024]) tuple(%z, %p)
  ROOT %loop = (s32[], f32[1024,1024]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_loops_conditionals_count_their_longest_branch_every_iteration():
  """A pipeline's tick loop: each tick runs one branch of a conditional (the stage's op, by index) and a
  predicated one (the last stage's head). Each counts its longest branch (a 1024^3 matmul at the roofline, against
  a branch that does nothing, whichever comes first), x the 4 iterations: 8 matmuls, not the first branch only."""
  from jaxtrain.parallel import devices
  row = devices.TABLE["H100"]
  matmul = max(2 * 1024**3 / row.peak_bf16_flops, 3 * 4 * 2**20 / row.bandwidth)
  tot = overlap.report(gpu_compile.Hlo.parse(LOOPED), row)["totals"]
  assert tot["compute_seconds"] == pytest.approx(8 * matmul)
  assert tot["matmul_flops"] == pytest.approx(8 * 2 * 1024**3)


def test_matmul_flops_take_the_branch_the_time_takes():
  """matmul_flops counts what compute_seconds counts: one branch of each conditional (its longest) every iteration,
  not every branch's dots. Here the indexed conditional's branches are two 1024^3 matmuls and one (the predicated
  one does nothing): 4 ticks x 2 matmuls, where the sum of every branch would be 4 x 3."""
  from jaxtrain.parallel import devices
  text = LOOPED.replace("ROOT %a = f32[1024,1024]{1,0} parameter(0)",
                        "%a0 = f32[1024,1024]{1,0} parameter(0)\n  %a1 = f32[1024,1024]{1,0} dot(%a0, %a0), "
                        "lhs_contracting_dims={1}, rhs_contracting_dims={0}\n  ROOT %a = f32[1024,1024]{1,0} "
                        "dot(%a1, %a1), lhs_contracting_dims={1}, rhs_contracting_dims={0}", 1)
  text = text.replace("true_computation=%work2", "true_computation=%idle2")
  row = devices.TABLE["H100"]
  matmul = max(2 * 1024**3 / row.peak_bf16_flops, 3 * 4 * 2**20 / row.bandwidth)
  tot = overlap.report(gpu_compile.Hlo.parse(text), row)["totals"]
  assert tot["compute_seconds"] == pytest.approx(4 * 2 * matmul)
  assert tot["matmul_flops"] == pytest.approx(4 * 2 * 2 * 1024**3)


def test_a_pipelines_tick_switch_counts_each_ticks_slowest_device():
  """Given the schedule's branch of every (tick, stage), the indexed conditional of a loop of as many iterations
  as ticks runs per tick the branch of its slowest device: here ticks 1 and 2 have a device on the matmul branch
  (2 matmuls), ticks 0 and 3 none; the predicated conditional still counts its longest (4). Per device, FLOPs count
  its own branches: stage 0 runs the matmul at tick 2 only (1 + 4), stage 1 at ticks 1 and 2 (2 + 4)."""
  from jaxtrain.parallel import devices
  row = devices.TABLE["H100"]
  matmul = max(2 * 1024**3 / row.peak_bf16_flops, 3 * 4 * 2**20 / row.bandwidth)
  tot = overlap.report(gpu_compile.Hlo.parse(LOOPED), row, ticks=[[0, 0], [0, 1], [1, 1], [0, 0]])["totals"]
  assert tot["compute_seconds"] == pytest.approx(6 * matmul)
  assert tot["matmul_flops_per_stage"] == pytest.approx([5 * 2 * 1024**3, 6 * 2 * 1024**3])
  assert tot["matmul_flops"] == pytest.approx(5.5 * 2 * 1024**3)
  # a table whose ticks do not match the loop's trip count leaves the longest-branch count as it was
  other = overlap.report(gpu_compile.Hlo.parse(LOOPED), row, ticks=[[1, 1]] * 3)["totals"]
  assert other.pop("pipeline_ticks_counted") is False and tot["pipeline_ticks_counted"] is True
  assert other == overlap.report(gpu_compile.Hlo.parse(LOOPED), row)["totals"]
