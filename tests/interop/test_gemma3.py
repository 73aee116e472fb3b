"""Gemma 3 (text) in and out of Hugging Face: a tiny random Gemma3ForCausalLM imports with the logits of
`transformers` (scanned and not, on a sharded mesh), exports to tensors transformers loads back with the same
logits, and generates its greedy tokens; its config fields jaxtrain cannot compute are refused in one line."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from jaxtrain.core.errors import UserError  # noqa: E402
from jaxtrain.interop import hf  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.interop.test_generate import _generate  # noqa: E402
from tests.interop.test_hf import IDS  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 90]]  # the first longer than the window
CASES = {"fsdp=2,tp=2": (), "fsdp=1": ("model.scan_layers=true",)}  # layer by layer; one scanned mixed stack


@pytest.fixture(scope="module", params=sorted(CASES))
def imported(request, tmp_path_factory):
  spec = request.param
  d = tmp_path_factory.mktemp("gemma3")
  ref = H.gemma3(d / "hf")
  H.imported(d / "hf", d / "w", spec, CASES[spec])
  return d, ref, spec, H.load(d / "w", spec)


@pytest.mark.slow  # whole-model compiles
def test_gemma3_imports_and_exports_with_the_logits_of_transformers(imported, tmp_path):
  d, ref, spec, (cfg, model, _) = imported
  m = cfg.model
  assert m.layer_windows() == (4, 4, 4, 4, 4, 0) and m.layer_types == "5:1"
  assert (m.rope_local_theta, m.rope_theta, m.rope_scaling, m.rope_factor) == (10.0, 1000.0, "linear", 2.0)
  assert m.attention_scale == pytest.approx(24 ** -0.5) and m.tie_embeddings
  theirs = H.torch_logits(ref, IDS)
  assert H.rel_err(H.jax_logits(model, IDS), theirs) < 1e-5
  H.exports_back(d, spec, tmp_path / "out", ref, theirs, IDS)


@pytest.mark.slow
def test_gemma3_greedy_generation_equals_transformers(imported):
  d, ref, spec, loaded = imported
  assert _generate(loaded, PROMPTS, spec) == H.transformers_greedy(ref, PROMPTS, 20)


BASE = {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("field,value,named", [
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("hidden_activation", "gelu", "hidden_activation='gelu'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'")])
def test_gemma3_fields_jaxtrain_cannot_compute_are_refused_in_one_line(field, value, named):
  with pytest.raises(UserError) as e:
    hf.model_keys({**BASE, field: value}, "config.json")
  assert named in str(e.value) and "\n" not in str(e.value)


def test_gemma3_defaults_read_as_transformers_reads_them():
  """Left-out fields: every 6th layer global, window 4096, local base 10000, global 1e6, query_pre_attn_scalar 256,
  tied: what Gemma3TextConfig fills in."""
  import transformers
  c = transformers.Gemma3TextConfig(**{k: v for k, v in BASE.items() if k != "model_type"})
  keys = hf.model_keys(json.loads(c.to_json_string()), "config.json")
  rope = c.rope_parameters
  assert keys["layer_types"] == "5:1" and keys["sliding_window"] == c.sliding_window
  assert keys["rope_local_theta"] == rope["sliding_attention"]["rope_theta"]
  assert keys["rope_theta"] == rope["full_attention"]["rope_theta"]
  assert keys["attention_scale"] == pytest.approx(c.query_pre_attn_scalar ** -0.5)
  assert keys["tie_embeddings"] is c.tie_word_embeddings
  assert hf.model_keys(BASE, "config.json") == keys


@pytest.mark.parametrize("sets,named", [
    (["model.mlp_activation=gelu_tanh", "model.moe_experts=4"], ("model.mlp_activation='gelu_tanh'", "moe_experts=4")),
    (["model.attention_scale=0.1", "model.attention_type=mla"], ("model.attention_scale=0.1", "attention_type=mla"))])
def test_gemma_keys_that_cannot_combine_are_refused_in_one_line(sets, named):
  from jaxtrain.core import config
  with pytest.raises(UserError) as e:
    config.load("tiny", sets)
  assert all(n in str(e.value) for n in named) and "\n" not in str(e.value)


def test_local_rope_base_acts_only_on_local_layers():
  """model.rope_local_theta: the local layers' tables differ from the global ones, which keep rope_theta and its
  linear scaling (every frequency / factor); without a window the key has nothing to act on (one table pair)."""
  import dataclasses

  from jaxtrain.core import config
  from jaxtrain.model.layers import layer_tables, rope_tables
  m = dataclasses.replace(config.load("tiny").model, sliding_window=4, rope_local_theta=10.0, rope_theta=1000.0,
                          rope_scaling="linear", rope_factor=2.0)
  pos = np.arange(8)[None]
  tables = rope_tables(pos, m)
  half = m.head_dim // 2
  for window, theta, factor in ((4, 10.0, 1.0), (0, 1000.0, 2.0)):
    want = pos[:, :, None, None] * (theta ** (-np.arange(half) / half) / factor)
    np.testing.assert_allclose(np.asarray(layer_tables(tables, window)[0]), np.sin(want), rtol=1e-5, atol=1e-6)
  assert len(rope_tables(pos, dataclasses.replace(m, sliding_window=0))) == 2
