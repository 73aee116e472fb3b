"""Keys that act only when another key (or the mesh) says so (issue 54, item 8): set where they act not, they are
named once ("ignored: ...") and left out of the fingerprint, so that a resume without them is the same run."""

import pytest

from jaxtrain.core import config
from jaxtrain.core.errors import UserError
from jaxtrain.run import checkpoint

NO_MESH = {}  # one device: no pipeline, data, tensor or sequence axis

# (preset, --set that makes the condition hold or not, the key set, the mesh's axes): written out by hand
IDLE = [
    ("tiny", [], "model.lora_alpha=32", NO_MESH),
    ("tiny", [], "model.lora_targets=q,k,o", NO_MESH),
    ("tiny", ["train.objective=lm"], "train.dpo_beta=0.5", NO_MESH),
    ("tiny", [], "pipeline.schedule=gpipe", {"data": 2, "tensor": 2}),
    ("tiny", [], "pipeline.virtual_stages=2", {"fsdp": 4}),
    ("tiny", [], "optim.zero_stage=1", {"fsdp": 2, "tensor": 2}),
    ("tiny", [], "run.sequence_parallel=true", {"data": 2}),
    ("tiny", ["train.objective=dpo"], "data.eval_source=bundled", NO_MESH),
    ("tiny", [], "data.eval_batches=9", NO_MESH),
    ("tiny", [], "model.moe_top_k=1", NO_MESH),  # dense: no experts
    ("tiny", [], "model.moe_aux_weight=0.5", NO_MESH),
    ("moe-tiny", ["model.moe_dropless=true"], "model.moe_capacity_factor=2", NO_MESH),
    ("moe-tiny", ["model.moe_dropless=false"], "model.moe_grouped_matmul=blocks", NO_MESH),
    ("tiny", ["model.dtype=bfloat16"], "loss_scale.initial=1024", NO_MESH),  # no loss scaling under bf16
    ("tiny", ["model.dtype=float32", "loss_scale.mode=auto"], "loss_scale.growth_interval=7", NO_MESH),
    ("tiny", [], "model.rope_factor=4", NO_MESH),  # rope_scaling none
    ("tiny", ["model.rope_scaling=llama3"], "model.rope_beta_fast=8", NO_MESH),
    ("tiny", [], "model.kv_lora_rank=64", NO_MESH),  # grouped-query attention: no latent
    ("tiny", [], "data.weights=1", NO_MESH),  # one source
    ("tiny", ["data.source=some/prepared_dir"], "data.text_field=body", NO_MESH),
]

# the same keys where they act: not named, and part of the fingerprint (math keys) as before
ACTIVE = [
    ("tiny", ["model.lora_rank=4"], "model.lora_alpha=32", NO_MESH),
    ("tiny", ["model.lora_rank=4"], "model.lora_targets=q,k,o", NO_MESH),
    ("tiny", ["train.objective=dpo"], "train.dpo_beta=0.5", NO_MESH),
    ("tiny", [], "pipeline.schedule=gpipe", {"pipeline": 2}),
    ("tiny", [], "optim.zero_stage=1", {"data": 2}),
    ("tiny", ["train.eval_interval=2"], "data.eval_source=bundled", NO_MESH),
    ("moe-tiny", [], "model.moe_top_k=1", NO_MESH),
    ("moe-tiny", ["model.moe_dropless=false"], "model.moe_capacity_factor=2", NO_MESH),
    ("tiny", ["model.dtype=float16"], "loss_scale.initial=1024", NO_MESH),
    ("tiny", ["loss_scale.mode=dynamic"], "loss_scale.initial=1024", NO_MESH),
    ("tiny", ["model.rope_scaling=llama3"], "model.rope_factor=4", NO_MESH),
    ("tiny", ["data.source=a.jsonl"], "data.text_field=body", NO_MESH),
]


def _fp(cfg):
  return checkpoint.fingerprint(cfg, "tok", "data")


@pytest.mark.parametrize("preset,base,setting,axes", IDLE, ids=[c[2] for c in IDLE])
def test_a_key_that_acts_not_is_named_once_and_left_out_of_the_fingerprint(preset, base, setting, axes):
  key = setting.partition("=")[0]
  cfg, plain = config.load(preset, [*base, setting]), config.load(preset, base)
  said = config.ignored(cfg, axes)
  assert len(said) == 1 and said[0].startswith(f"{key}=") and "acts only with" in said[0], said
  assert config.ignored(plain, axes) == []
  assert _fp(cfg) == _fp(plain)  # a resume without the key (or with another value) is the same run


@pytest.mark.parametrize("preset,base,setting,axes", ACTIVE, ids=[c[2] for c in ACTIVE])
def test_the_same_key_where_it_acts_is_not_named_and_is_fingerprinted(preset, base, setting, axes):
  key = setting.partition("=")[0]
  cfg, plain = config.load(preset, [*base, setting]), config.load(preset, base)
  assert config.ignored(cfg, axes) == []
  if config.category(key) is not None:
    assert _fp(cfg) != _fp(plain)


def test_mesh_rules_hold_only_keys_outside_the_fingerprint():
  """The fingerprint is taken without the mesh: a rule that reads it may only cover keys that steer the run."""
  keys = config.all_keys()
  for rule in config.DEPENDENT:
    assert set(rule.keys) <= set(keys), rule.keys
    if rule.mesh:
      assert all(config.category(k) is None for k in rule.keys), rule.keys


def test_the_plan_line_names_what_the_mesh_leaves_idle():
  from jaxtrain.parallel import plan as plan_lib
  from tests.helpers import mesh_of
  cfg = config.load("tiny", ["optim.zero_stage=2", "pipeline.schedule=gpipe", "model.lora_alpha=8"])
  text = plan_lib.build(cfg, mesh_of("fsdp=2")).describe()
  ignored = [line for line in text.splitlines() if line.startswith("ignored: ")]
  assert len(ignored) == 1 and "optim.zero_stage=2" in ignored[0] and "pipeline.schedule='gpipe'" in ignored[0]
  assert "model.lora_alpha=8.0 (acts only with model.lora_rank > 0)" in ignored[0]
  assert "zero-0" in text  # and the plan acts by the same rule
  acting = plan_lib.build(cfg, mesh_of("dp=2")).describe()
  assert "optim.zero_stage" not in acting and "zero-2" in acting


@pytest.mark.parametrize("spelled", ["q, v", " q ,v", "q,  v "])
def test_lora_targets_with_spaces_are_the_plain_list(spelled):
  cfg = config.load("tiny", ["model.lora_rank=4", f"model.lora_targets={spelled}"])
  plain = config.load("tiny", ["model.lora_rank=4", "model.lora_targets=q,v"])
  assert cfg.model.lora_targets == "q,v" and cfg.model.lora_target_names() == ("q", "v")
  assert _fp(cfg) == _fp(plain)


@pytest.mark.parametrize("spelled", ["q,", ",q", "q,,v", ","])
def test_lora_targets_with_an_empty_item_are_refused(spelled):
  with pytest.raises(UserError, match="model.lora_targets .*empty") as e:
    config.load("tiny", ["model.lora_rank=4", f"model.lora_targets={spelled}"])
  assert "\n" not in str(e.value)
