"""A pipeline compiled by XLA's GPU compiler for compile-only H100s: cuDNN attention inside the pipeline
region (its custom partitioning fails in a partially manual region; the stage plan runs it fully manual)
and the bill's arguments. Needs the CUDA plugin (the gpu-aot extra); skips without it."""

import pytest

from jaxtrain.analysis import gpu_compile, memory, report
from jaxtrain.core import config
from jaxtrain.run import step as step_lib

from tests.helpers import needs_plugin

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'


@needs_plugin
def test_zb_h1_with_cudnn_attention_compiles_for_h100s():
  cfg = config.load("tiny", ["model.n_layers=4", "model.scan_layers=true", "model.dtype=bfloat16", "train.seq_len=96",
                             "train.batch_size=8", "train.microbatches=2", "pipeline.schedule=zb-h1"])
  setup = step_lib.Setup(cfg, gpu_compile.mesh("H100", "pp=2,fsdp=2"))
  assert setup.plan.attention == "cudnn"
  c = report.compiled_memory(setup)
  assert c["backend"] == "cuda" and c["cudnn_attention"]["ops"] >= 2, c  # forward and backward
  batch = 5 * 4 * 8 * 96 // 2  # int32 inputs, targets, positions, segment ids, loss mask, split over fsdp
  assert c["arguments"] == sum(memory.state_bytes(setup).values()) + batch
  # the weights' gradients are reduce-scattered per layer, as outside a pipeline: unconstrained inside the
  # region, XLA all-reduced each layer's whole (llama3.1-70b on pp=4,fsdp=16: 702 GiB per step, 64 GiB of them kept)
  assert c["collectives"]["all-reduce"]["bytes_per_step"] < memory.state_bytes(setup)["params"], c["collectives"]
  # the roofline counts the ticks as the schedule runs them, not XLA's longest branch on every tick
  roof, ticks = c["roofline"], c["overlap"]["totals"]
  assert ticks["pipeline_ticks_counted"] and roof["bound"] == "per-kernel", roof
  assert roof["seconds"] == ticks["compute_seconds"] and roof["xla_cost_analysis_seconds"] > 0
  assert "the tick switch's longest branch on every tick" in "\n".join(report.render_compiled(c))


@needs_plugin
def test_dualpipev_runs_one_microbatchs_expert_all_to_alls_under_anothers_compute():
  """MoE on pp=2 x ep=2 compiled for H100s. In the branch that pairs a forward with another microbatch's whole
  backward, XLA schedules matmuls under the expert all-to-alls (the two share no value: the matmuls under a
  forward's dispatch are the backward's, and the reverse); in the branches that run a forward or a backward alone
  no all-to-all has a matmul of note under it (a projection here is 6.7e7 FLOPs; 1e7 is the line)."""
  from jaxtrain.analysis import overlap
  from jaxtrain.parallel import devices, pipeline, program
  cfg = config.load("tiny", ["model.moe_experts=8", "model.moe_top_k=2", "model.n_layers=4", "model.scan_layers=true",
                             "model.dtype=bfloat16", "model.d_model=256", "model.n_heads=4", "model.head_dim=64",
                             "model.d_ff=512", "model.attention=xla", "train.seq_len=256", "train.batch_size=32",
                             "train.microbatches=8", "pipeline.schedule=dualpipev"])
  setup = step_lib.Setup(cfg, gpu_compile.mesh("H100", "pp=2,ep=2"))
  hlo = gpu_compile.Hlo.parse(gpu_compile.compile_step(setup)[0].as_text())
  used = sorted(set(program.program_table(pipeline.table(setup.cfg, setup.mesh))[0][..., program.BRANCH].flat))
  switch = next(i for i in hlo.instrs if i.opcode == "conditional" and i.rest.count("region") >= len(used))
  names = [b.strip().lstrip("%") for b in switch.rest.split("branch_computations={")[1].split("}")[0].split(",")]
  assert len(names) == len(used), names
  branch = dict(zip(used, names))
  a2a = [r for r in overlap.report(hlo, devices.TABLE["H100"])["collectives"] if r["kind"] == "all-to-all"]
  under = {k: [r["flops_under"] for r in a2a if r["computation"] == branch[k]]
           for k in (program.FWD, program.BWD, program.PAIRED[program.BWD])}
  print("FLOPs under each all-to-all, forward / backward / pair:", *([f"{f:.2g}" for f in v] for v in under.values()))
  # a forward: dispatch and combine of its one MoE layer; a backward recomputes them and adds their transposes
  assert [len(v) for v in under.values()] == [2, 4, 6], under
  assert max(under[program.FWD] + under[program.BWD]) < 1e7, under
  assert sum(f > 1e7 for f in under[program.PAIRED[program.BWD]]) >= 2, under


def _tiny_pipeline(schedule: str, spec: str, extra=()):
  """tiny with 4 layers, batch 8 of 4 microbatches, compiled for H100s: (setup, parsed optimized HLO)."""
  cfg = config.load("tiny", ["model.n_layers=4", "model.scan_layers=true", "model.dtype=bfloat16",
                             "train.batch_size=8", "train.microbatches=4", f"pipeline.schedule={schedule}", *extra])
  setup = step_lib.Setup(cfg, gpu_compile.mesh("H100", spec))
  return setup, gpu_compile.Hlo.parse(gpu_compile.compile_step(setup)[0].as_text())


@pytest.fixture(scope="module")
def one_stage_reference():
  """matmul FLOPs of one device running the last stage's work without a pipeline: 2 of the 4 layers and the head
  over all 4 microbatches, each layer's forward recomputed in its backward (remat full) as a pipeline's is."""
  from jaxtrain.analysis import overlap
  from jaxtrain.parallel import devices
  _, hlo = _tiny_pipeline("1f1b", "fsdp=1", ["model.n_layers=2", "model.remat=full"])
  return overlap.report(hlo, devices.TABLE["H100"])["totals"]["matmul_flops"]


def _op_costs(hlo, cost, used):
  """{(branch kind, runs the last chunk): seconds} of the tick switch's branches, from their computations: the last
  chunk's runs its head terms (the longer branch of the branch's own predicated conditional), another the shorter."""
  from jaxtrain.parallel import program
  switch = next(i for i in hlo.instrs if i.opcode == "conditional" and len(gpu_compile.branches(i)) == len(used))
  out = {}
  for k, name in zip(used, gpu_compile.branches(switch)):
    heads = [i for i in hlo.instrs if i.computation == name and "true_computation" in i.rest]
    spans = [sorted(cost.computation(b) for b in gpu_compile.branches(i)) for i in heads]
    whole = cost.computation(name)
    out[k, True], out[k, False] = whole, whole - sum(hi - lo for lo, hi in spans)
  assert out[program.FWD, True] > out[program.FWD, False] and out[program.BWD, True] > out[program.BWD, False]
  return out


@needs_plugin
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_predicted_step_counts_each_tick_as_the_schedule_runs_it(schedule, one_stage_reference):
  """pipeline=2, 4 microbatches. Each tick costs the slowest device's op (idle, F or B; with the head terms on the
  last chunk's device), read from the switch's branch computations and the schedule's table, not the longest branch
  every tick (1.6x too slow here, 2x the matmuls). gpipe: within the bubble formula, per-device work of m
  microbatches x (m + p - 1) / m, of the first and of the last stage (the tick loop's buffer updates and the work
  outside it on top: 7% measured); 1f1b runs F beside B in its lock-step ticks. Per device, the matmuls are its own
  stage's work of the m microbatches (idle ticks add none): of the last within 10% of a one-device program of the
  same layers and head (measured 1.082: the pipeline's backward computes the head's logits again, and 2 x tokens x
  d_model x vocab more outside the ticks), of the first within 10% of that program less its head's 6 x tokens x
  d_model x vocab (measured 1.047: those outside the ticks)."""
  from jaxtrain.analysis import overlap
  from jaxtrain.parallel import devices, pipeline, program
  setup, hlo = _tiny_pipeline(schedule, "pp=2")
  row, t = devices.TABLE["H100"], pipeline.table(setup.cfg, setup.mesh)
  cost = overlap.Costs(hlo, row)
  op = _op_costs(hlo, cost, pipeline.switch_indices(program.program_table(t)[0]))
  kind = {None: program.IDLE, 1: program.FWD, 2: program.BWD}  # schedule F, B -> the program's branch kinds
  ticks = sum(max(op[kind[c.kind if c else None], bool(c) and t.chunk_of(s, c.chunk) == t.chunks - 1]
                  for s, c in enumerate(cells)) for cells in t.grid)
  old = overlap.report(hlo, row)["totals"]
  new = overlap.report(hlo, row, **pipeline.tick_table(setup.cfg, setup.mesh))["totals"]
  longest = op[program.BWD, True]
  assert new["compute_seconds"] - ticks == pytest.approx(old["compute_seconds"] - t.ticks * longest, rel=1e-9)
  bubble = (t.m + t.p - 1) / t.m
  first, last = (t.m * (op[program.FWD, h] + op[program.BWD, h]) * bubble for h in (False, True))
  print(f"{schedule}: predicted compute {new['compute_seconds'] * 1e6:.1f} us (was {old['compute_seconds'] * 1e6:.1f}),"
        f" ticks {ticks * 1e6:.1f} us; bubble formula {first * 1e6:.1f} - {last * 1e6:.1f} us")
  if schedule == "gpipe":
    assert first <= ticks <= last and new["compute_seconds"] <= 1.1 * last
  assert new["compute_seconds"] < old["compute_seconds"] / 1.15
  mm = setup.cfg.model
  head = 6 * setup.cfg.train.batch_size * setup.cfg.train.seq_len * mm.d_model * mm.vocab_size
  first_mm, last_mm = new["matmul_flops_per_stage"]
  print(f"matmuls per stage {first_mm:.4g}, {last_mm:.4g}; one stage without a pipeline {one_stage_reference:.4g}")
  assert one_stage_reference <= last_mm <= 1.1 * one_stage_reference
  assert one_stage_reference - head <= first_mm <= 1.1 * (one_stage_reference - head)
  assert new["matmul_flops"] == pytest.approx((first_mm + last_mm) / 2)
