"""Every pair of options is the same run or a one-line refusal: the rows of the pairwise covering array
(tests/parity/covering.py) each train 2 steps on their mesh and on one device, the losses and gradient norms equal
at the tolerance of their dtype; the refused pairs stop with a one-line error naming both options.

Tolerances, relative, per step on loss and grad norm: float32 1e-5, as every parity test; float16 (loss-scaled)
1e-3, its rounding step 2^-10 (a reduction in another order moves the gradient norm by a part of it: up to 4.3e-4
measured on these rows); bfloat16 2e-2 and FP8 5e-2 (8 and 4 bits of mantissa: up to 2.0e-3 and 1.1e-7 measured
here, the FP8 rows being float32 or float16 compute; the bounds leave room for a rounding step of a large
element)."""

import jax
import numpy as np
import pytest

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.parallel import plan as plan_lib
from jaxtrain.run import step
from tests.helpers import mesh_of
from tests.parity import covering
from tests.run.test_dpo import preference_data

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

STEPS = 2
BASE = ["model.d_model=32", "model.n_heads=4", "model.head_dim=8", "model.d_ff=64",
        "model.vocab_size=384", "train.batch_size=16", "train.seq_len=16", "train.steps=20", "optim.warmup_steps=1",
        "train.loss_chunk_tokens=32", "loss_scale.initial=1024"]
ATTENTION = {"mha": ["model.n_kv_heads=4"], "gqa": ["model.n_kv_heads=2"],
             "mla": ["model.attention_type=mla", "model.q_lora_rank=16", "model.kv_lora_rank=16",
                     "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8"]}
MOE = {"dense": [], "capacity": ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_expert_d_ff=32"],
       "dropless": ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_expert_d_ff=32", "model.moe_dropless=true"]}
WINDOW = {"none": [], "local": ["model.sliding_window=4"],  # of train.seq_len=16
          "alternate": ["model.sliding_window=4", "model.layer_types=alternate"]}
GEMMA = ["model.norm_convention=one_plus", "model.post_norms=true", "model.embed_scale=true", "model.attention_scale=0.25"]  # 0.25: not head_dim 8's 1/sqrt(8)
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 2e-2}
FAST = {"xla_backend_optimization_level": 0}  # LLVM at -O0, both sides: half the compile time
FP8_TOLERANCE = 5e-2
STORED_TOLERANCE = 1e-2  # a step after moments stored in bfloat16 or int8 (see the row test)


@pytest.fixture(scope="session")
def pairs_source(tmp_path_factory) -> str:
  """The preference data of the DPO rows, prepared once."""
  return preference_data(tmp_path_factory.mktemp("pairs"))


def overrides(row: dict, source: str = "unset") -> list[str]:
  """The config of a matrix row (what is not in force stays at the default): 1 layer, 2 on a pipeline's 2 stages,
  4 where it runs two chunks per device. Microbatches: 1 or several, several being 2, or 4 under dualpipev (it
  pairs forwards with backwards from 2 x pipeline microbatches on). A DPO row reads the preference data at
  `source`, 32 rows a batch (16 pairs: an even number of rows on each of up to 8 batch devices in each of 2
  microbatches)."""
  on = lambda name: covering.BY_NAME[name].active(row)  # noqa: E731
  layers = (4 if row["schedule"] in ("interleaved", "zbv", "dualpipev") else 2) if on("schedule") else (
      2 if row["window"] == "alternate" else 1)  # a local and a global layer
  micro = 4 if on("schedule") and row["schedule"] == "dualpipev" and row["microbatches"] == 2 else row["microbatches"]
  sets = [*BASE, f"model.n_layers={layers}", *ATTENTION[row["attention"]], *MOE[row["moe"]],
          f"model.tie_embeddings={str(row['tied']).lower()}", f"model.qk_norm={str(row['qk_norm']).lower()}",
          f"model.remat={row['remat']}", f"model.scan_layers={str(row['scan_layers']).lower()}",
          f"model.fp8={row['fp8']}", f"model.dtype={row['dtype']}", f"optim.zero_stage={row['zero_stage']}",
          f"optim.offload={row['offload']}", f"train.microbatches={micro}",
          f"run.sequence_parallel={str(row['sequence_parallel']).lower()}", f"optim.name={row['optim']}",
          f"run.trackers={'' if row['trackers'] == 'none' else row['trackers']}",
          f"optim.state_dtype={row['state_dtype']}",
          f"optim.in_backward={str(row['in_backward']).lower()}"]
  if row["eval_tasks"]:  # the names are checked by the run (with lm-eval), not by the Setup these rows build
    sets += ["train.eval_tasks=tiny_mc", "train.eval_tasks_interval=1"]
  if row["mtp"]:
    sets += ["model.mtp_layers=1", "model.mtp_weight=0.3"]
  if row["qk_clip"]:  # below every head's largest logit (about 0.05 here): each is clipped, far from the threshold
    sets += ["optim.qk_clip=0.001"]
  if on("routing_bias") and row["routing_bias"]:
    sets += ["model.moe_bias_rate=0.01"]
  if on("sequence_attention"):
    sets += [f"model.sequence_attention={row['sequence_attention']}"]
  if on("schedule"):
    sets += [f"pipeline.schedule={row['schedule']}"]
  if row["lora"] != "off":
    attn = "q_a,q_b,kv_a,kv_b,o" if row["attention"] == "mla" else "q,k,v,o"  # every projection the attention has
    sets += ["model.lora_rank=4", f"model.lora_targets={attn},gate,up,down"]
    sets += ["model.lora_base_dtype=nf4"] if row["lora"] == "nf4" else []
  sets += WINDOW[row["window"]] + (["model.attention_sinks=true"] if row["sinks"] else [])
  sets += ["model.attention=blocked"] if row["kernel"] == "blocked" else []  # seq_len 16: 4 blocks of 4
  sets += [f"model.attention_bias={str(row['attention_bias']).lower()}", f"model.mlp_activation={row['activation']}"]
  if on("moe_bias") and row["moe_bias"]:
    sets += ["model.moe_bias=true"]
  if on("gemma") and row["gemma"]:
    sets += GEMMA + (["model.rope_local_theta=100"] if row["window"] != "none" else [])
  if row["objective"] == "dpo":
    sets += ["train.objective=dpo", "train.dpo_beta=0.1", f"data.source={source}", "train.batch_size=32"]
  if row.get("schedule_in", "steps") != "steps":  # 2 steps of 16 (DPO 32) rows: the ramp's first size is those
    rows = 32 if row["objective"] == "dpo" else 16
    sets = [x for x in sets if x != "optim.warmup_steps=1"]  # warmup in tokens instead (both: refused)
    sets += ["train.tokens=16384", "optim.warmup_tokens=400", f"optim.lr_reference_batch={rows}"]
    if row["schedule_in"] == "ramp":
      sets += [f"train.batch_ramp=0:{rows},1e9:{2 * rows}", f"train.batch_size={2 * rows}"]
  return sets


def mesh_spec(row: dict) -> str:
  return ",".join(f"{a}=2" for a in covering.AXES if row[a] == 2) or "data=1"


def trajectory(cfg, spec: str, init=None):
  """(loss, grad_norm) of each of STEPS steps on mesh `spec` (the data the run would read), and the initial state
  on the host; `init`: start from that state (the one-device run's) instead of initializing again."""
  setup = step.Setup(cfg, mesh_of(spec))
  batches = data.batches(cfg)
  out = []
  try:
    state = setup.init() if init is None else jax.device_put(init, setup.state_shardings)
    first = jax.device_get(state) if init is None else init
    batch = setup.device_batch(next(batches))
    compiled = setup.step.lower(state, batch).compile(FAST)
    for i in range(STEPS + (cfg.optim.state_dtype != "float32")):  # a 3rd step: the 2nd update reads stored moments
      state, m = compiled(state, batch if i == 0 else setup.device_batch(next(batches)))
      assert not bool(m["skipped"]), f"a step was skipped on {spec}"
      out.append((float(m["loss"]), float(m["grad_norm"])))
  finally:
    batches.close()
  return np.array(out), first


ROWS = covering.matrix()
STEPS_RUN = covering.math_rows(ROWS)  # a row that differs from an earlier one only in covering.VIEWS: the same step


@pytest.mark.parametrize("row", STEPS_RUN, ids=[f"row{i}:{mesh_spec(r)}" for i, r in enumerate(STEPS_RUN)])
def test_a_row_of_the_matrix_equals_its_one_device_run(row, pairs_source):
  # the same config: with what the row's mesh implies (a pipeline's stacked layers) on one device too
  cfg, _ = plan_lib.implied(config.load("tiny", overrides(row, pairs_source)), mesh_of(mesh_spec(row)))
  ref, init = trajectory(cfg, "data=1")
  got, _ = trajectory(cfg, mesh_spec(row), init)
  rtol = FP8_TOLERANCE if row["fp8"] != "none" else TOLERANCE[row["dtype"]]
  msg = f"{mesh_spec(row)} {overrides(row)[len(BASE) + 1:]}"
  np.testing.assert_allclose(got[:STEPS], ref[:STEPS], rtol=rtol, err_msg=msg)
  # the 3rd step reads moments stored below float32: a last-bit difference of the mesh's gradient can flip one
  # stored value's rounding (bfloat16: 2^-8 relative), so that step holds to the stored dtype's resolution
  np.testing.assert_allclose(got[STEPS:], ref[STEPS:], rtol=max(rtol, STORED_TOLERANCE), err_msg=msg)


@pytest.mark.parametrize("row,words,why", covering.refusal_rows(), ids=lambda x: str(x)[:40])
def test_a_refused_pair_is_one_line_naming_both_options(row, words, why, pairs_source):
  with pytest.raises(UserError) as e:
    step.Setup(config.load("tiny", overrides(row, pairs_source)), mesh_of(mesh_spec(row)))
  msg = str(e.value)
  assert "\n" not in msg and all(w in msg for w in words), (msg, words, why)


def test_the_matrix_covers_every_pair_that_can_run():
  covered = set().union(*(covering._pairs(r) for r in ROWS))  # noqa: SLF001
  assert covering.all_pairs() <= covered and len(covered) > 1000
  assert not any(covering.refused(r) for r in ROWS) and all(covering.feasible(r) for r in ROWS)
