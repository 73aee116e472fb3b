import dataclasses

import pytest

from jaxtrain.core import config
from jaxtrain.model import transformer as model
from jaxtrain.core.errors import UserError


@pytest.mark.parametrize("name, count", [("llama3-8b", 8_030_261_248), ("llama3-1b", 1_235_814_400)])
def test_real_shapes_parameter_count(name, count):
  _, state = model.abstract(config.load(name).model)
  assert model.param_count(state) == count


def test_overrides_are_typed():
  cfg = config.load("tiny", ["optim.lr=1e-4", "model.tie_embeddings=true", "model.dtype=float32", "train.steps=7"])
  assert cfg.optim.lr == 1e-4 and cfg.model.tie_embeddings is True and cfg.model.dtype == "float32"
  assert cfg.train.steps == 7


@pytest.mark.parametrize("override, words", [
    ("train.nope=1", ["unknown config key 'train.nope'", "batch_size", "seq_len"]),
    ("optimizer.lr=1", ["unknown config section 'optimizer'", "model, optim, train, run, loss_scale, checkpoint"]),
    ("model.dtype=float64", ["model.dtype='float64'", "bfloat16, float16, float32"]),
    ("train.batch_size=1.5", ["train.batch_size='1.5'", "not an integer"]),
    ("optim.lr=fast", ["not a number"]),
    ("train.batch_size=0", ["below its minimum"]),
    ("train.microbatches=3", ["must divide train.batch_size=16"]),
    ("lr=1", ["section.key=value"]),
])
def test_bad_overrides_name_the_key_and_what_is_allowed(override, words):
  with pytest.raises(UserError) as e:
    config.load("tiny", [override])
  for w in words:
    assert w in str(e.value)


def test_unknown_key_in_a_file_is_rejected(tmp_path):
  p = tmp_path / "c.toml"
  p.write_text("[train]\nbatch_sise = 4\n")
  with pytest.raises(UserError, match="unknown config key 'train.batch_sise'"):
    config.load(str(p))
  with pytest.raises(UserError, match="presets: .*tiny"):
    config.load("no-such-preset")


def test_help_lists_every_key_with_type_default_and_meaning():
  text = config.help_text()
  for section, cls in config.SECTIONS.items():
    for f in dataclasses.fields(cls):
      line = next(l for l in text.splitlines() if l.strip().startswith(f"{section}.{f.name} ("))
      assert f"default {f.default!r}" in line
  assert "one of bfloat16, float16, float32" in text
