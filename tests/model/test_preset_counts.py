"""Every preset of a Hugging Face family has exactly the parameters `transformers` builds from the config.json
that `hf export` would write for it (instantiated on the meta device: nothing allocated, nothing downloaded)."""

import dataclasses

import pytest

pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from jaxtrain.core import config  # noqa: E402
from jaxtrain.interop import hf  # noqa: E402
from jaxtrain.model import transformer as model_lib  # noqa: E402

# Add a family's presets here: each is counted both ways.
PRESETS = ["llama3-1b", "llama3-8b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b", "mixtral-8x7b",
           "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b", "gemma-3-1b", "gemma-3-4b",
           "gemma-3-12b", "gemma-3-27b"]


def _count(module) -> int:
  return model_lib.param_count(nnx.state(module, nnx.Param))


def jaxtrain_count(m) -> int:
  """The model's own parameter shapes: the parts outside the blocks plus each block (traced once per kind:
  tracing all 126 layers of 405B abstractly takes half a minute)."""
  outside = _count(nnx.eval_shape(lambda: model_lib.Transformer(dataclasses.replace(m, n_layers=0, scan_layers=False),
                                                                nnx.Rngs(0))))
  block = {moe: _count(nnx.eval_shape(lambda moe=moe: model_lib.Block(m, nnx.Rngs(0), moe)))
           for moe in {m.is_moe_layer(i) for i in range(m.n_layers)}}
  return outside + sum(block[m.is_moe_layer(i)] for i in range(m.n_layers))


def transformers_count(cfg) -> int:
  import torch
  import transformers
  fields = hf.hf_config(cfg, {}, "bfloat16")
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(fields.pop("model_type"), **fields))
  return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parameter_count_equals_transformers(name):
  cfg = config.load(name)
  assert jaxtrain_count(cfg.model) == transformers_count(cfg)
