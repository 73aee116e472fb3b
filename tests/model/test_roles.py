"""The parameter-role table (jaxtrain.model.roles): every parameter of every preset has a role, and the rules give
what the families need (a hand-written list per kind of parameter, not the table's own words)."""

import jax
import pytest
from flax import nnx

from jaxtrain.core import config
from jaxtrain.model import roles, transformer as model_lib

# The presets, plus the option each one leaves out, so every parameter any family has is seen.
EXTRA = {"deepseek-v3-tiny": ["model.mtp_layers=1"], "moe-tiny": ["model.moe_bias_rate=0.01",
                                                                 "model.moe_shared_experts=1"],
         "tiny": ["model.tie_embeddings=true", "model.lora_rank=2", "model.lora_targets=q,k,v,o,gate,up,down"]}


@pytest.mark.parametrize("name", config.preset_names())
def test_every_parameter_of_every_preset_has_a_role(name):
  """Two layers of each (the same parameters as all of them, traced in a fraction of the time)."""
  dense_first = ["model.moe_first_dense=1"] if config.load(name).model.moe_first_dense else []
  cfg = config.load(name, ["model.n_layers=2", *dense_first, *EXTRA.get(name, [])])
  _, state = model_lib.abstract(cfg.model)
  params = nnx.to_pure_dict(state)
  table = roles.tree(cfg.model, params)  # raises for a parameter without a role
  assert len(jax.tree.leaves(table)) == len(jax.tree.leaves(params))


def _by_name(cfg):
  _, state = model_lib.abstract(cfg.model)
  flat = jax.tree_util.tree_leaves_with_path(roles.tree(cfg.model, nnx.to_pure_dict(state)))
  return {"/".join(roles.keys_of(p)): r for p, r in flat}


def test_decay_is_every_matrix_but_the_embedding():
  cfg = config.load("deepseek-v3-tiny", ["model.mtp_layers=1", "model.scan_layers=true"])
  got = _by_name(cfg)
  decayed = {k for k, r in got.items() if r.decayed}
  matrices = {k for k in got if k.rsplit("/", 1)[-1] in (
      "wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w_gate", "w_up", "w_down", "router", "lm_head", "eh_proj")}
  assert decayed == matrices, decayed ^ matrices
  assert any(k.endswith("mlp/router") for k in decayed)  # the router is a matrix (on main it was not decayed)


def test_head_stacked_cast_and_router_bias():
  cfg = config.load("deepseek-v3-tiny", ["model.mtp_layers=1", "model.scan_layers=true"])
  got = _by_name(cfg)
  # the MTP module embeds its targets where the tokens are embedded (before a pipeline's region): not the head's
  assert {k.split("/")[0] for k, r in got.items() if r.head} == {"final_norm", "lm_head", "mtp"}
  assert {k.split("/")[0] for k, r in got.items() if r.stacked} == {"dense_layers", "layers"}
  assert {k for k, r in got.items() if r.router_bias} == {"layers/mlp/router_bias", "mtp/block/mlp/router_bias"}
  assert not got["layers/mlp/router"].cast_at_use and got["layers/attn/wkv_b"].cast_at_use and got["embed"].cast_at_use
  assert not got["final_norm/scale"].cast_at_use
  plain = _by_name(config.load("tiny"))  # untied, no MTP: the embedding is only the lookup
  assert not plain["embed"].head and plain["lm_head"].head and plain["lm_head"].output
  tied = _by_name(config.load("tiny", ["model.tie_embeddings=true"]))
  assert tied["embed"].head and tied["embed"].output and tied["embed"].matmul and not plain["embed"].matmul


def test_an_unknown_parameter_has_no_role():
  with pytest.raises(KeyError, match="has no role"):
    roles.of(config.load("tiny").model, ("layers", 0, "attn", "w_new"))


def test_lora_freezes_all_but_the_adapters():
  """With model.lora_rank: only the adapters train (and are decayed, as PEFT's AdamW decays them); the frozen
  weights cast at use are kept in the compute dtype, the frozen norms in float32."""
  got = _by_name(config.load("tiny", ["model.lora_rank=2", "model.lora_targets=q,down", "model.scan_layers=true"]))
  trained = {k for k, r in got.items() if not r.frozen}
  assert trained == {"layers/attn/wq_lora/lora_a", "layers/attn/wq_lora/lora_b", "layers/mlp/w_down_lora/lora_a",
                     "layers/mlp/w_down_lora/lora_b"}
  assert all(got[k].decayed and got[k].stacked and not got[k].low_master for k in trained)
  assert got["layers/attn/wq"].low_master and got["embed"].low_master and got["lm_head"].low_master
  assert not got["final_norm/scale"].low_master and got["final_norm/scale"].frozen
  assert not any(r.frozen for r in _by_name(config.load("tiny")).values())
