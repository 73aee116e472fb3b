"""The execution plan: it decides the attention kernel once, for the target device, and the
compiled step runs that kernel."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.analysis import report
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.model import attention as attention_lib, flash
from jaxtrain.parallel import kernels, plan as plan_lib
from jaxtrain.run import step
from tests.helpers import mesh_of, trajectory


def test_the_plan_decides_the_kernel_once_and_it_is_what_runs(monkeypatch):
  cfg = config.load("tiny", ["model.dtype=float32", "train.batch_size=4", "train.seq_len=32", "model.n_layers=1"])
  called = []
  real = attention_lib.attention  # the spies compute the reference (cuDNN cannot run on CPU)
  monkeypatch.setattr(attention_lib, "attention", lambda *a, **kw: called.append("xla") or real(*a, **kw))
  monkeypatch.setattr(kernels, "fused", lambda *a, **kw: called.append("cudnn") or real(*a[:4]))
  monkeypatch.setattr(flash, "attention", lambda *a, **kw: called.append("blocked") or real(*a[:4]))
  for spec, forced, want in [("dp=2", None, "xla"), ("dp=2", "cudnn", "cudnn"), ("sp=2", None, "ring"),
                             ("dp=2", "blocked", "blocked")]:
    mesh = mesh_of(spec)
    plan = plan_lib.build(cfg, mesh)
    if forced:  # what an H100 target would decide
      plan = dataclasses.replace(plan, attention=forced)
    setup = step.Setup(cfg, mesh, plan)
    called.clear()
    batch = {k: jax.ShapeDtypeStruct((4, 32), jnp.int32, sharding=setup.batch_sharding)
             for k in ("inputs", "targets", "loss_mask", "segment_ids", "positions")}
    hlo = setup.step.lower(jax.eval_shape(setup.init), batch).as_text()
    assert plan.describe().startswith(f"attention: {want} ")
    assert ("collective_permute" in hlo) == (want == "ring") and set(called) == ({want} - {"ring"}), spec


def test_the_plan_never_names_cudnn_where_the_ring_runs():
  cfg = config.load("tiny", ["model.attention=cudnn"])
  with pytest.raises(UserError, match="model.attention=cudnn cannot run with sequence=2"):
    plan_lib.build(cfg, mesh_of("sp=2"))
  # For an H100 target (compiled ahead of time on this machine) the plan picks cuDNN.
  h100 = type("Device", (), {"platform": "gpu", "compute_capability": "9.0", "device_kind": "NVIDIA H100"})()
  assert plan_lib.build(config.load("tiny"), mesh_of("dp=2"), device=h100).attention == "cudnn"


def _compiled(sets, spec):
  """(the plan's start-up line, the compiled step's HLO text, its memory analysis) for tiny + `sets` on `spec`."""
  from jaxtrain.analysis import gpu_compile as gc
  setup = step.Setup(config.load("tiny", ["model.dtype=float32", "train.batch_size=8", "train.seq_len=32",
                                          "model.n_layers=2", *sets]), mesh_of(spec))
  compiled = setup.step.lower(*gc.abstract_inputs(setup)).compile()
  return setup.plan.describe(), compiled.as_text(), compiled.memory_analysis()


def _collectives(hlo: str) -> dict:
  """How many of each collective the compiled program runs (text count)."""
  kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
  return {k: len(re.findall(rf" {k}(?:-start)?\(", hlo)) for k in kinds}


# (config key, its two values, the mesh, the words each value puts in the plan line, what the program shows)
CHOICES = [
    ("model.remat", ("none", "full"), "dp=2", ("remat none", "remat full"),
     lambda hlo, mem: len(re.findall(r" dot\(", hlo))),  # the recomputed forward's matmuls
    ("run.sequence_parallel", ("false", "true"), "tp=2", ("", "sequence-parallel residual stream"),
     lambda hlo, mem: _collectives(hlo)),
    ("model.fp8", ("none", "tensorwise"), "dp=2", ("", "FP8 projections (model.fp8=tensorwise)"),
     lambda hlo, mem: "f8e4m3fn" in hlo),
    ("optim.zero_stage", ("0", "2"), "dp=2", ("zero-0", "zero-2"), lambda hlo, mem: _collectives(hlo)),
    ("optim.offload", ("none", "host"), "dp=2", ("", "host memory"),
     lambda hlo, mem: report.host_argument_bytes(hlo)),  # master and moments laid out in host memory
    ("model.sequence_attention", ("ring", "ulysses"), "sp=2", ("ring attention", "ulysses over sequence=2"),
     lambda hlo, mem: ("collective-permute" in hlo, "all-to-all" in hlo)),
]


@pytest.mark.slow
@pytest.mark.parametrize("key,values,spec,words,shows", CHOICES, ids=[c[0] for c in CHOICES])
def test_each_printed_choice_is_what_the_program_runs(key, values, spec, words, shows):
  """One source per choice: changing the config key changes the plan line and the compiled program with it."""
  lines, programs = [], []
  for value, word in zip(values, words):
    line, hlo, mem = _compiled([f"{key}={value}"], spec)
    assert word in line, (key, value, line)
    lines.append(line)
    programs.append(shows(hlo, mem))
  assert lines[0] != lines[1] and programs[0] != programs[1], (key, programs)


@pytest.mark.slow
def test_the_moe_kernel_and_groups_in_the_plan_line_are_what_runs():
  """model.moe_dropless and model.moe_group_size: the plan line names the dispatch the step runs, and the losses
  follow (capacity groups drop tokens, the dropless kernel drops none)."""
  from tests.helpers import trajectory
  base = ["model.dtype=float32", "train.batch_size=8", "train.seq_len=32", "model.moe_experts=4",
          "model.moe_capacity_factor=0.5", "model.n_layers=1", "model.d_model=32", "model.d_ff=64",
          "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8"]
  runs = {}
  for extra, word in ((["model.moe_group_size=8"], "capacity groups of 8 tokens"),
                      ([], "capacity groups of 32 tokens"), (["model.moe_dropless=true"], "dropless, blocks")):
    cfg = config.load("tiny", base + extra)
    assert word in step.Setup(cfg, mesh_of("ep=2")).plan.describe()
    runs[word] = trajectory(cfg, "ep=2", 1)[0, 0]
  assert len(set(runs.values())) == 3, runs  # groups of 8 drop other tokens than groups of 32; dropless none


def _gathered_types(cfg, spec):
  """The element types of the all-gathers in the compiled step's HLO."""
  from jaxtrain import data
  setup = step.Setup(cfg, mesh_of(spec))
  it = data.batches(cfg)
  batch = setup.device_batch(next(it))
  it.close()
  text = setup.step.lower(setup.init(), batch).compile().as_text()
  return re.findall(r"= (\w+)\[[\d,]*\]\S* all-gather(?:-start)?\(", text)


def test_weights_cross_a_cpu_mesh_in_the_compute_dtype_and_the_step_is_unchanged(monkeypatch):
  """XLA:CPU gathers a bfloat16 array as float32, and a weight the model casts at use it gathers in float32 and
  casts after. The plan casts where the weight is stored and gathers the bits (`Plan.cast`): on fsdp=4 x tensor=2
  every all-gather of the bfloat16 step moves 16-bit values, where the plain cast gathers float32, and the two
  steps' losses and gradient norms are the plain cast's bit for bit (the same values cross, the gradient is
  reduced in float32 as before)."""
  cfg = config.load("tiny", ["model.dtype=bfloat16", "model.n_layers=2", "train.batch_size=8", "train.seq_len=32"])
  got, kinds = trajectory(cfg, "fsdp=4,tp=2", 2), _gathered_types(cfg, "fsdp=4,tp=2")
  assert "u16" in kinds and not {"f32", "bf16"} & set(kinds), kinds  # (s32: the token ids)
  from jaxtrain.model import ops
  monkeypatch.setattr(plan_lib.Plan, "cast", ops.Ops.cast)
  want, plain = trajectory(cfg, "fsdp=4,tp=2", 2), _gathered_types(cfg, "fsdp=4,tp=2")
  assert "f32" in plain, plain
  np.testing.assert_array_equal(got, want)


# ---- the loss's chunks (train.loss_chunk_tokens=-1): the plan's choice for its device ----

LLAMA_VOCAB = 128256  # llama3-1b's: a token's float32 logits are 513,024 bytes


@pytest.mark.parametrize("device,batch,spec,want", [
    ("H200", 4, None, 8192),  # 4 x 2048 x 513,024 = 4.20e9 bytes <= 141e9 / 32 = 4.41e9: one chunk of all
    ("H200", 8, None, 8192),  # 8.40e9 > 4.41e9; 4.41e9 / 513,024 = 8589 -> 8 rows x 1024 positions (a divisor)
    ("H100", 4, None, 4096),  # 80 GiB / 32 = 2.68e9 -> 5232 tokens -> 4 rows x 1024
    ("H100", 1, None, 2048),  # 1.05e9
    ("H100", 4, "tensor=2", 8192),  # the vocabulary split in two: 2.10e9 a device
    ("H100", 16, "fsdp=2", 4096),  # 8 rows a device: as batch 8 on one, 5232 -> 8 x 512
    ("H100", 2, "dp=2", 2048),  # a device's 1 row x 2048
    ("A100-SXM4-40GB", 4, None, 2048),  # 1.34e9 -> 2616 tokens -> 4 x 512
    (None, 4, None, 1024),  # this host's CPU: the reference's 1024 (no GPU measured the rule)
    ("TPU v5p", 4, None, 1024),
])
def test_the_automatic_loss_takes_the_fewest_chunks_whose_logits_fit_a_32nd_of_the_gpu(device, batch, spec, want):
  cfg = config.load("llama3-1b", [f"train.batch_size={batch}", "train.seq_len=2048"])
  plan = plan_lib.build(cfg, mesh_of(spec) if spec else None, device=device)
  assert cfg.model.vocab_size == LLAMA_VOCAB and plan.loss_chunk_tokens == want, plan.loss_why
  assert f" of {want} tokens a device" in plan.describe() and "plain" not in plan.loss_why
  given = plan_lib.build(config.load("llama3-1b", ["train.loss_chunk_tokens=2048"]), None, device=device)
  assert given.loss_chunk_tokens == 2048  # a number the user sets is what runs, on any device


def test_the_loss_follows_the_installed_plans_chunks():
  from jaxtrain.model import loss as xent, ops
  rng = np.random.default_rng(0)
  h, w = jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.float32), jnp.asarray(rng.normal(size=(8, 32)), jnp.float32)
  t, m = jnp.asarray(rng.integers(0, 32, (2, 16))), jnp.ones((2, 16), jnp.float32)
  plan = plan_lib.local(config.load("tiny"))
  for chunk, loops in ((0, 0), (8, 1)):  # the plain loss has no loop; 8 tokens of 32 a scan over 4 chunks
    with ops.use(dataclasses.replace(plan, loss_chunk_tokens=chunk)):
      hlo = jax.jit(lambda h: xent.nll_sum(h, w, t, m, -1)).lower(h).as_text()
      got = float(jax.jit(lambda h: xent.nll_sum(h, w, t, m, -1))(h))
    assert hlo.count("stablehlo.while") == loops, chunk
    assert got == pytest.approx(float(xent.nll_sum(h, w, t, m, chunk)), rel=1e-6)


def test_the_bill_counts_the_loss_the_target_device_runs():
  """inspect's bill for an H200 holds one chunk of the whole logits (8192 tokens a device), for an H100 two chunks
  of 4096: the loss phase differs by float32 logits and their gradient of 4096 tokens (2 x 4 x V x 4096 bytes)."""
  cfg = config.load("llama3-1b", ["train.batch_size=4", "train.seq_len=2048"])
  work = {dev: report.report(cfg, mesh_of("data=1"), "llama3-1b", device=dev)["memory"]["items"]["workspace"]
          for dev in ("H200", "H100")}
  assert work["H200"] - work["H100"] == 2 * 4 * LLAMA_VOCAB * (8192 - 4096), work


def test_the_plan_line_says_dpo_takes_the_whole_logits():
  """DPO's objective sums each sequence's log-probabilities from the whole logits (run/dpo.py): the chunks are only
  its evaluation loss's."""
  line = plan_lib.build(config.load("tiny", ["train.objective=dpo"]), None, device="H100").describe()
  assert "loss: DPO's log-probabilities from the whole logits; evaluation: 1 chunk of 2048 tokens a device (float32 " \
         "logits 4.0 MiB" in line, line
