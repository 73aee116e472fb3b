"""A Hugging Face checkpoint whose config.json says tie_word_embeddings=true and which also holds lm_head.weight
(issue 38): transformers 5 (PreTrainedModel.tie_weights) ties the head to the embedding only where the two hold
the same values; a different head is kept, untied. The import gives transformers' logits either way."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from jaxtrain import hf as hf_command  # noqa: E402
from tests import hf_models as H  # noqa: E402

IDS = np.random.default_rng(3).integers(0, 96, (2, 12))


def _with_head(d, *, tie: bool, head_from: str | None):
  """Rewrites the checkpoint in `d`: config.json's tie_word_embeddings = `tie`; lm_head.weight a copy of the
  embedding (head_from="embed") or left as saved (None)."""
  from safetensors.numpy import load_file, save_file
  t = load_file(str(d / "model.safetensors"))
  if head_from == "embed":
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
  save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
  c = json.loads((d / "config.json").read_text())
  c["tie_word_embeddings"] = tie
  (d / "config.json").write_text(json.dumps(c))


def _transformers(d):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


@pytest.mark.slow  # an import and a compile of the model
@pytest.mark.parametrize("case", ["own-head", "head-equal-to-embedding"])
def test_tied_config_with_a_head_gives_transformers_logits(case, tmp_path, capsys):
  d = tmp_path / "hf"
  if case == "own-head":  # an untied model's head, under a config that says tied
    H.llama(d, tied=False)
    _with_head(d, tie=True, head_from=None)
  else:  # a tied model saved with its (equal) head written out, as torch .bin conversions do
    H.llama(d, tied=True)
    _with_head(d, tie=True, head_from="embed")
  ref = _transformers(d)
  own = case == "own-head"
  # the reference: transformers keeps a different head, ties an equal one
  assert (ref.lm_head.weight.data_ptr() != ref.model.embed_tokens.weight.data_ptr()) == own
  H.imported(d, tmp_path / "w")
  cfg, model, params = H.load(tmp_path / "w")
  assert cfg.model.tie_embeddings is (not own) and ("lm_head" in params) == own
  assert H.rel_err(H.jax_logits(model, IDS), H.torch_logits(ref, IDS)) < 1e-5
  assert ("imported untied" in capsys.readouterr().err) == own


def test_forcing_a_tie_over_a_different_head_is_one_line(tmp_path, capsys):
  d = tmp_path / "hf"
  H.llama(d, tied=False)
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    hf_command.main(["import", str(d), "--workdir", str(tmp_path / "w"), "--set", "model.tie_embeddings=true"])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1, err
  assert "lm_head.weight differs from model.embed_tokens.weight" in err[0]
  assert not (tmp_path / "w").exists()
