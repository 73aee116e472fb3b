"""Pipeline parallelism: loss parity with one device for every schedule and composition,
exact resume and resharding, the 1F1B memory bound, and the shape of the compiled program.

Every compiled run is shared through the module-scoped `runs` cache."""

import dataclasses
import json
import re

import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline, program
from jaxtrain.parallel import schedule
from jaxtrain.run import step
from jaxtrain.core.errors import UserError
from tests.helpers import mesh_of, needs_plugin

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

STEPS = 3
# 8 layers: 4 chunks of 2 on pp=2 interleaved, 8 chunks of 1 on pp=4 interleaved.
BASE = ["model.n_layers=8", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8",
        "model.d_ff=64", "model.dtype=float32", "model.scan_layers=true", "train.batch_size=16", "train.seq_len=16",
        "train.microbatches=4"]
# With the aux-free routing bias: its per-layer loads come from each chunk's forwards.
MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0", "model.n_layers=4",
       "model.moe_bias_rate=0.01"]


def cfg_of(*extra):
  return config.load("tiny", BASE + list(extra))


@pytest.fixture(scope="module")
def runs():
  """(spec, overrides...) -> (per-step [loss, grad_norm, loss_scale], compiled step); each compiled once."""
  cache = {}

  def run(spec, *extra):
    key = (spec, *extra)
    if key not in cache:
      cfg = cfg_of(*extra)
      setup = step.Setup(cfg, mesh_of(spec))
      it = data.batches(cfg)
      batches = [setup.device_batch(next(it)) for _ in range(STEPS)]
      it.close()
      state = setup.init()
      compiled = setup.step.lower(state, batches[0]).compile()
      out = []
      for b in batches:
        state, m = compiled(state, b)
        out.append((float(m["loss"]), float(m["grad_norm"]), float(m["loss_scale"]),
                    float(m.get("moe_load_imbalance", np.nan))))
      cache[key] = (np.array(out), compiled)
    return cache[key]
  return run


SCHEDULES = {"gpipe": ["pipeline.schedule=gpipe"], "1f1b": ["pipeline.schedule=1f1b"],
             "interleaved": ["pipeline.schedule=interleaved", "pipeline.virtual_stages=2"],
             "zb-h1": ["pipeline.schedule=zb-h1"], "zbv": ["pipeline.schedule=zbv", "pipeline.virtual_stages=2"],
             "dualpipev": ["pipeline.schedule=dualpipev"]}  # (virtual_stages=2 implied)
# pp=4: m=16 and 64 tokens for gpipe/1f1b/zb-h1 (shared with the memory tests: the stash shows in the
# temporaries' peak), m=8 for interleaved (8 chunks).
LONG = ["train.microbatches=16", "train.seq_len=64"]
# (pp=2 with 1f1b, interleaved, zb-h1 and zbv beside every other option: the pairwise matrix, tests/parity)
PARITY = ([("pp=2", "gpipe", [])]
          + [("pp=4", "gpipe", LONG), ("pp=4", "1f1b", LONG),
             ("pp=4", "interleaved", ["train.microbatches=8"]),
             # the loss in 8-token chunks (4 rows x 2 positions; 8 chunks per microbatch), vocab over tensor
             ("pp=2,fsdp=2,tp=2", "1f1b", ["train.loss_chunk_tokens=8"]),
             # zbv's V moves activations both ways and keeps the turn on the last device (zb-h1 and MoE on
             # pp=2 beside data and expert axes: the matrix)
             ("pp=4", "zbv", []),
             ("pp=2,fsdp=2,tp=2", "zbv", ["run.sequence_parallel=true"]),
             # dualpipev's paired ticks (a forward beside another microbatch's backward) from 2p microbatches on
             ("pp=4", "dualpipev", ["train.microbatches=8"]),
             ("pp=2,fsdp=2,tp=2", "dualpipev", ["run.sequence_parallel=true"])])


def assert_parity(got, ref, what):
  assert got[-1, 0] < got[0, 0], f"{what}: loss does not go down"
  np.testing.assert_allclose(got[:, 0], ref[:, 0], rtol=1e-5, err_msg=f"loss on {what}")
  np.testing.assert_allclose(got[:, 1], ref[:, 1], rtol=1e-5, err_msg=f"grad_norm on {what}")


@pytest.mark.parametrize("spec,name,extra", PARITY, ids=[f"{s}-{n}" for s, n, _ in PARITY])
def test_loss_parity_with_one_device(runs, spec, name, extra):
  ref, _ = runs("dp=1", *(["train.seq_len=64"] if extra == LONG else []))
  got, _ = runs(spec, *SCHEDULES[name], *extra)
  assert_parity(got, ref, f"{spec} {name} {extra}")


def test_dualpipev_moe_on_pipeline_x_expert_equals_one_device(runs):
  """MoE with the aux-free routing bias on pp=2 x ep=2 under dualpipev: a pair's forward (its all-to-alls, its
  routing loads) and its backward are independent in one tick; losses, gradient norms and load imbalance equal
  one device's."""
  ref, _ = runs("dp=1", *MOE)
  got, _ = runs("pp=2,ep=2", *SCHEDULES["dualpipev"], *MOE)
  assert_parity(got, ref, "pp=2,ep=2 dualpipev MoE")
  np.testing.assert_allclose(got[:, 3], ref[:, 3], rtol=1e-5, err_msg="load imbalance")


def test_moe_hf_aux_convention_under_pipeline_is_a_one_line_error():
  with pytest.raises(UserError, match="moe_aux_convention=hf is not supported with mesh pipeline=2"):
    step.check_fits_mesh(cfg_of(*MOE, "model.moe_aux_convention=hf", "pipeline.schedule=1f1b"), mesh_of("pp=2,ep=2"))


def test_1f1b_stash_is_about_p_over_m_of_gpipe(runs):
  """p=4, m=16, 64 tokens. Stash = the chunk inputs a device keeps for its backward passes: 16
  slots for gpipe, 4 (= p) for 1f1b, here 8,192 B each (1 row x 64 tokens x d_model 32 x
  float32). XLA's temporaries also hold the gradient accumulators and one chunk's backward,
  the same for both. Measured (CPU, jax 0.10.2): gpipe 1,493,880 B, 1f1b 1,395,576 B of
  temporaries; the difference, 98,304 B, is exactly the 12 stash slots 1f1b does not
  allocate. Asserted with margin: the compiled difference is at least 90% of the stash
  difference, and 1f1b's slots (+1 discard slot) are at most (p + 1) / (m + 1) of gpipe's."""
  p, m = 4, 16
  _, g = runs("pp=4", *SCHEDULES["gpipe"], *LONG)
  _, f = runs("pp=4", *SCHEDULES["1f1b"], *LONG)
  slot_bytes = (16 // m) * 64 * 32 * 4  # one microbatch's chunk input: rows x seq x d_model x float32
  _, s_g, _, _ = program.program_table(schedule.build("gpipe", p, m))
  _, s_f, _, _ = program.program_table(schedule.build("1f1b", p, m))
  assert (s_g, s_f) == (m, p)
  tg, tf = g.memory_analysis().temp_size_in_bytes, f.memory_analysis().temp_size_in_bytes
  print(f"temporaries: gpipe {tg:,} B, 1f1b {tf:,} B; stash slots {s_g} vs {s_f} of {slot_bytes:,} B")
  assert tg - tf >= 0.9 * (s_g - s_f) * slot_bytes
  assert (s_f + 1) / (s_g + 1) <= (p + 1) / (m + 1)


@needs_plugin
@pytest.mark.slow
def test_zb_h1_temporaries_are_1f1bs_plus_the_slots_w_keeps():
  """p=4, m=16, compiled for H100s (the program a GPU runs: one branch per tick). B frees the chunk input and the
  output gradient (W no longer recomputes) and leaves each projection's input and output gradient in a W slot until
  its W: zb-h1's temporaries are at most 1F1B's, plus its W slots (+1 discard), plus the difference in stash and
  gradient slots of 8,192 B each (64 tokens), plus 2% of XLA's own for the two backward branches."""
  from jaxtrain.analysis import gpu_compile as gc, timeline
  p, m = 4, 16
  temps, setups = {}, {}
  for name in ("1f1b", "zb-h1"):
    setups[name] = step.Setup(cfg_of(*SCHEDULES[name], *LONG, "model.attention=xla"), gc.mesh("H100", "pp=4"))
    temps[name] = gc.compile_step(setups[name])[0].memory_analysis().temp_size_in_bytes
  slot_bytes = (16 // m) * 64 * 32 * 4
  _, s_f, g_f, _ = program.program_table(schedule.build("1f1b", p, m))
  _, s_z, g_z, w_z = program.program_table(schedule.build("zb-h1", p, m))
  w_pass = timeline.slot_costs(setups["zb-h1"])["w_bytes"]
  assert s_z <= s_f and w_pass > 0
  tf, tz = temps["1f1b"], temps["zb-h1"]
  print(f"temporaries: 1f1b {tf:,} B, zb-h1 {tz:,} B ({w_z} W slots of {w_pass:,} B)")
  assert tz <= tf + (s_z + g_z - s_f - g_f) * slot_bytes + (w_z + 1) * w_pass + 0.02 * tf


# float32, MoE (experts and router differentiated in B) with MLA's projections and the MTP module (on the last
# chunk, whose head terms B differentiates); FP8 projections (W gives its products FP8 operands)
SPLIT_CASES = {"moe-mla-mtp": MOE[:3] + ["model.attention_type=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
                                         "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
                                         "model.v_head_dim=8", "model.mtp_layers=1", "model.mtp_weight=0.3",
                                         "model.n_layers=4"],
               "fp8": ["model.fp8=tensorwise", "model.n_layers=4"]}


@pytest.mark.parametrize("case,name", [("moe-mla-mtp", "zbv"), ("fp8", "zb-h1")])
def test_split_backward_gives_the_whole_backwards_gradients(runs, case, name):
  """B then W (no forward or activation gradient twice) against 1F1B's whole backward, same mesh and order of
  microbatches: the same losses and gradient norms to float32 rounding."""
  ref, _ = runs("pp=2", *SCHEDULES["1f1b"], *SPLIT_CASES[case])
  got, _ = runs("pp=2", *SCHEDULES[name], *SPLIT_CASES[case])
  np.testing.assert_allclose(got[:, :2], ref[:, :2], rtol=1e-6, err_msg=f"{name} {case}")


def test_eval_runs_the_pipelined_forward():
  """pp=2: the eval step is the schedule's forwards (activations by collective-permute, no layer gathered
  over `pipeline`) and its loss is the one-device eval's on the same params and batch."""
  cfg = cfg_of()
  it = data.batches(cfg)
  local = next(it)
  it.close()
  out = {}
  for spec in ("dp=1", "pp=2"):
    setup = step.Setup(cfg, mesh_of(spec))
    params, batch = setup.init()["params"], setup.device_batch(local)
    compiled = setup.eval_step.lower(params, batch).compile()
    out[spec] = compiled(params, batch), compiled.as_text()
  (ref, _), (got, hlo) = out["dp=1"], out["pp=2"]
  assert "collective-permute" in hlo and "all-gather" not in hlo
  assert int(got["tokens"]) == int(ref["tokens"])
  np.testing.assert_allclose(float(got["loss_sum"]), float(ref["loss_sum"]), rtol=1e-5)


def test_compiled_program_is_a_pipeline(runs):
  """pp=4: activations and gradients move by collective-permute between pipeline
  neighbours; the layer stack is never all-gathered over `pipeline`."""
  _, c = runs("pp=4", *SCHEDULES["1f1b"], *LONG)
  hlo = c.as_text()
  permutes = re.findall(r"source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", hlo)
  pairs = {(int(a), int(b)) for ps in permutes for a, b in re.findall(r"(\d+),(\d+)", ps)}
  assert {(0, 1), (1, 2), (2, 3)} <= pairs and {(1, 0), (2, 1), (3, 2)} <= pairs, pairs
  # The only mesh axis is pipeline, so any all-gather would be one over pipeline.
  assert "all-gather" not in hlo


def test_embedding_table_is_not_gathered_whole(runs):
  """pp=2,fsdp=2,tp=2: the tokens are embedded before the pipeline region, from the table as stored; inside it
  XLA gathered the whole float32 table (vocab x d_model) for every op of chunk 0 (llama3.1-70b: 3.9 GiB)."""
  _, c = runs("pp=2,fsdp=2,tp=2", *SCHEDULES["1f1b"], "train.loss_chunk_tokens=8")
  m = cfg_of().model
  gathered = re.findall(r"= (\S+) all-gather(?:-start)?\(", c.as_text())
  assert gathered and not [g for g in gathered if g.startswith(f"f32[{m.vocab_size},{m.d_model}]{{")], gathered


@pytest.mark.parametrize("extra,msg", [
    (["model.n_layers=6"], "model.n_layers=6 must divide into pipeline=4"),
    (["train.microbatches=2"], "train.microbatches=2 must be >= the pipeline stages (4)"),
    (["pipeline.schedule=interleaved", "pipeline.virtual_stages=3"], "model.n_layers=8 must divide into pipeline=4"),
])
def test_bad_pipeline_setups_are_one_line_errors(extra, msg):
  with pytest.raises(UserError, match=re.escape(msg)) as e:
    step.check_fits_mesh(cfg_of(*extra), mesh_of("pp=4"))
  assert "\n" not in str(e.value)
  with pytest.raises(UserError, match="sequence=2 is not supported"):
    step.check_fits_mesh(cfg_of(), mesh_of("pp=2,sp=2"))


@pytest.mark.parametrize("extra,want,note", [
    (["model.scan_layers=false"], {"scan_layers": True}, "model.scan_layers=true (pipeline=4"),
    (["pipeline.schedule=zbv"], {"virtual_stages": 2}, "pipeline.virtual_stages=2 (pipeline.schedule=zbv"),
    (["pipeline.schedule=interleaved"], {"virtual_stages": 2}, "pipeline.virtual_stages=2 (pipeline.schedule=inter"),
])
def test_settings_a_pipeline_implies_are_set_and_said(extra, want, note):
  """A pipeline runs stacked layers, zbv two chunks per device, interleaved at least two: set, not demanded, and
  named in the plan line; the same config without a pipeline axis keeps what the user wrote."""
  from jaxtrain.parallel import plan as plan_lib
  cfg = cfg_of(*extra)
  plan = plan_lib.build(cfg, mesh_of("pp=4"))
  got = {**dataclasses.asdict(plan.cfg.model), **dataclasses.asdict(plan.cfg.pipeline)}
  assert {k: got[k] for k in want} == want and note in plan.describe()
  step.check_fits_mesh(plan.cfg, mesh_of("pp=4"))
  assert plan_lib.build(cfg, mesh_of("dp=4")).cfg == cfg and "set by the mesh" not in plan_lib.build(
      cfg, mesh_of("dp=4")).describe()


def test_start_up_line_names_the_schedule():
  line = pipeline.describe(cfg_of(*SCHEDULES["interleaved"]), mesh_of("pp=2"))
  assert line.startswith("pipeline: interleaved, 2 stages x 2 virtual = 4 chunks of 2 layer(s), 4 microbatches")


def test_exact_resume_and_resharding_through_a_pipeline_run(tmp_path, capsys):
  """pp=2,dp=2 on zb-h1: 6 steps straight (checkpointing at 3); resumed from its step-3
  checkpoint in another workdir, steps 4-6 are the same bit for bit; the same checkpoint
  resumed on pp=2,fsdp=2 with zbv (another schedule: the layers in a V; another layout)
  continues the same run (to float32 rounding)."""
  from jaxtrain.run import loop
  common = ["train.steps=6", "checkpoint.interval=3", "checkpoint.async_save=false", "train.tensorboard=false"]
  cfg = cfg_of(*common, *SCHEDULES["zb-h1"])
  pp = mesh_of("pp=2,dp=2")

  def records(workdir, after=0):  # a resume in another workdir also gets the records its checkpoint carries
    return [r for line in (workdir / "metrics.jsonl").read_text().splitlines() if (r := json.loads(line))["step"] > after]
  loop.run(cfg, pp, tmp_path / "straight", "tiny", stop_at=6)
  straight = records(tmp_path / "straight")
  at3 = str(tmp_path / "straight" / "checkpoints" / "3")
  loop.run(cfg, pp, tmp_path / "resumed", "tiny", stop_at=6, resume_from=at3)
  resumed = records(tmp_path / "resumed", after=3)
  assert "pipeline: zb-h1, 2 stages" in capsys.readouterr().out
  key = lambda r: (r["step"], r["loss"], r["grad_norm"], r["tokens_seen"])  # noqa: E731
  assert [r["step"] for r in resumed] == [4, 5, 6]
  assert [key(r) for r in resumed] == [key(r) for r in straight[3:]]
  loop.run(cfg_of(*common, *SCHEDULES["zbv"]), mesh_of("pp=2,fsdp=2"), tmp_path / "moved", "tiny", stop_at=6,
           resume_from=at3)
  fsdp = records(tmp_path / "moved", after=3)
  out = capsys.readouterr().out
  assert "written on mesh pipeline=2,data=2, resharded" in out and "pipeline: zbv, 2 stages x 2 virtual" in out
  np.testing.assert_allclose([r["loss"] for r in fsdp], [r["loss"] for r in straight[3:]], rtol=1e-5)
  np.testing.assert_allclose([r["grad_norm"] for r in fsdp], [r["grad_norm"] for r in straight[3:]], rtol=1e-5)


def test_pipeline_axis_is_outermost_with_alias_pp():
  assert mesh_lib.parse("pp=4,fsdp=2")["pipeline"] == 4
  mesh = mesh_of("pp=2,tp=4")
  assert mesh.axis_names[0] == "pipeline"
  # Each pipeline stage is a contiguous block of devices (the rest of the mesh inside it).
  assert [d.id for d in mesh.devices.reshape(2, 4)[1]] == [4, 5, 6, 7]


def test_zero2_splits_the_pipelines_gradients_over_data():
  """optim.zero_stage=2 under pp=2,dp=2: the compiled step's temporaries fall by most of the gradient bytes the
  split saves a device (measured 1.00x while ZeRO-1 reduced each microbatch; 0.75x since ZeRO-1 accumulates
  unreduced in data_region, a program with less temporaries of its own). On main before issue 37 the pipeline's
  gradient function never got the gradient sharding: 33.20 MiB at either stage."""
  import math

  import jax
  from jaxtrain.analysis import gpu_compile as gc
  out = {}
  for z in (1, 2):
    cfg = config.load("tiny", ["model.scan_layers=true", "train.microbatches=2", "model.dtype=float32",
                               f"optim.zero_stage={z}"])
    setup = step.Setup(cfg, mesh_of("pp=2,dp=2"))
    grads = sum(math.prod(sh.shard_shape(x.shape)) * 4 for x, sh in zip(
        jax.tree.leaves(setup.abstract_state()["params"]), jax.tree.leaves(setup.grad_shardings)))
    temps = setup.step.lower(*gc.abstract_inputs(setup)).compile().memory_analysis().temp_size_in_bytes
    out[z] = temps, grads
    assert ("gradients split over data=2" in setup.plan.describe()) == (z == 2)
  saved = out[1][1] - out[2][1]
  assert saved > 0 and out[1][0] - out[2][0] >= 0.6 * saved, out


@pytest.mark.parametrize("spec", ["pp=2,fsdp=2"])
def test_bfloat16_pipeline_with_data_or_fsdp_runs_on_cpu_and_matches_one_device(spec):
  """The default dtype with a pipeline and a batch axis: on main XLA:CPU aborted compiling it ("Invalid binary
  instruction opcode copy": the chunked loss's bfloat16 head-gradient sum, a lax.reduce with a traced zero, whose
  reducer jax wraps in a sharding constraint inside the partly manual region). bfloat16 tolerance as the matrix's."""
  from tests.helpers import trajectory
  cfg = config.load("tiny", [*BASE[:6], "model.scan_layers=true", "train.batch_size=8", "train.seq_len=16",
                             "train.microbatches=2", "model.n_layers=4"])
  assert cfg.model.dtype == "bfloat16"
  np.testing.assert_allclose(trajectory(cfg, spec, 2), trajectory(cfg, "dp=1", 2), rtol=2e-2)


# The embedded tokens went from the table's d_model split to the activations' split, which XLA could do only by
# replicating them whole: fsdp x tensor (sequence-parallel) x pipeline, dense and MLA + MoE; data x expert x pipeline
# with ZeRO-2 (no data region: the ids' rows split over data and expert, the table's d_model over expert)
MLA_MOE = ["model.attention_type=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
           "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.moe_experts=4", "model.moe_top_k=2",
           "model.moe_expert_d_ff=32"]
REMAT_FREE = {"fsdp-tp-sp-dense": ("fsdp=2,tensor=2,pipeline=2", ["run.sequence_parallel=true"]),
              "fsdp-tp-sp-mla-moe": ("fsdp=2,tensor=2,pipeline=2", ["run.sequence_parallel=true", *MLA_MOE,
                                                                     "model.moe_dropless=true",
                                                                     "model.tie_embeddings=true"]),
              "dp-ep-zero2-moe": ("data=2,expert=2,pipeline=2", ["optim.zero_stage=2", *MLA_MOE])}


@pytest.mark.parametrize("name", REMAT_FREE)
def test_a_pipelined_step_compiles_without_full_rematerialization(name, tmp_path, capfd):
  """XLA's SPMD partitioner says on stderr where it cannot reshard a tensor but by replicating it whole and slicing
  it ("Involuntary full rematerialization"): memory and traffic wasted, and noise on the user's terminal. Compiled
  here with a fresh persistent cache (a loaded program would print nothing)."""
  import jax
  from jaxtrain.run import goodput
  spec, extra = REMAT_FREE[name]
  cfg = cfg_of("model.n_layers=2", "train.microbatches=2", *extra)
  setup = step.Setup(cfg, mesh_of(spec))
  state = setup.init()
  it = data.batches(cfg)
  batch = setup.device_batch(next(it))
  it.close()
  was = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "cache"))
  capfd.readouterr()
  count = goodput.CacheCount()
  try:
    setup.step.lower(state, batch).compile()
  finally:
    count.stop()
    jax.config.update("jax_compilation_cache_dir", was)
  err = capfd.readouterr().err
  assert count.verdict() in ("miss", "off"), count.verdict()  # compiled, not loaded
  remats = [line for line in err.splitlines() if "rematerialization" in line]
  assert not remats, "\n".join(remats)
