"""Qwen3 (dense and MoE) in and out of Hugging Face: logits equal to `transformers` after import and after
export, bit-identical round trips, greedy generation equal to `transformers.generate`, the KV cache equal to
recomputing, q/k norms on a tensor mesh equal to one device, and the configs refused with one line."""

import numpy as np
import pytest

pytest.importorskip("transformers")

from jaxtrain.core import config  # noqa: E402
from jaxtrain.core.errors import UserError  # noqa: E402
from jaxtrain.interop import hf, hf_export  # noqa: E402
from jaxtrain.run import checkpoint, runs  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of, trajectory  # noqa: E402
from tests.interop.test_generate import PROMPTS, _full_forward_greedy, _generate  # noqa: E402
from tests.interop.test_hf import (IDS, _bit_identical, _edited, _one_line_exit_2, _tensors,  # noqa: E402
                                   yarn_round_trip)

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

# family -> (builder, the mesh it is imported and generated on)
FAMILIES = {"qwen3": (H.qwen3, "fsdp=2,tp=2"), "qwen3_moe": (H.qwen3_moe, "expert=2")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
  """(dir with hf/ and w/, the torch model, mesh spec, (cfg, model, params) loaded on that mesh)."""
  build, spec = FAMILIES[request.param]
  d = tmp_path_factory.mktemp(request.param)
  ref = build(d / "hf")
  H.imported(d / "hf", d / "w", spec)
  return d, ref, spec, H.load(d / "w", spec)


def test_logits_match_transformers_after_import_and_after_export(imported, tmp_path):
  import torch
  import transformers
  d, ref, spec, (cfg, model, _) = imported
  m = cfg.model
  assert m.qk_norm and m.head_dim == 16 and m.d_model // m.n_heads == 8
  if m.moe_experts:  # the dense first layer, the raw (unnormalized) top-k scores, HF's dropless experts
    assert (m.moe_first_dense, m.moe_norm_top_k, m.moe_expert_d_ff, m.moe_dropless) == (1, False, 16, True)
  else:
    assert m.tie_embeddings
  theirs = H.torch_logits(ref, IDS)
  assert H.rel_err(H.jax_logits(model, IDS), theirs) < 1e-5
  step_dir = runs.locate(d / "w", 0)
  hf_export.run_export(runs.config_of(checkpoint.read_manifest(step_dir)), mesh_of(spec), step_dir, tmp_path / "out",
                "float32", 10**9, d / "w")
  _bit_identical(_tensors(d / "hf"), _tensors(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
  assert type(back) is type(ref)
  np.testing.assert_array_equal(H.torch_logits(back, IDS), theirs)


@pytest.mark.parametrize("rope,spec", [(H.QWEN3_YARN, "fsdp=1"), (H.QWEN3_YARN_MSCALE, "fsdp=2,tp=2")],
                         ids=["mscale-alone", "mscale"])
def test_qwen3_yarn_imports_and_exports_as_yarn(tmp_path, rope, spec):
  ref = H.qwen3(tmp_path / "hf", rope_scaling=dict(rope))
  yarn_round_trip(tmp_path, ref, rope, spec)


def test_greedy_generation_equals_transformers_and_the_full_forward(imported):
  d, ref, spec, loaded = imported
  ours = _generate(loaded, PROMPTS, spec)
  assert ours == H.transformers_greedy(ref, PROMPTS, 20)
  assert ours == _full_forward_greedy(loaded[1], PROMPTS, 20)  # the KV cache equals recomputing


def test_qk_norm_on_a_tensor_mesh_equals_one_device():
  """q/k norms with the heads split over tensor (their scales replicated): 3 steps on fsdp=2,tp=2 are the
  single-device run."""
  cfg = config.load("tiny", ["model.dtype=float32", "model.qk_norm=true", "model.scan_layers=true",
                             "train.batch_size=4", "train.seq_len=32"])
  ref = trajectory(cfg, "dp=1", 3)
  assert ref[-1, 0] < ref[0, 0]  # it trains
  np.testing.assert_allclose(trajectory(cfg, "fsdp=2,tp=2", 3), ref, rtol=1e-5)


def test_unsupported_qwen3_configs_are_one_line_and_exit_2(tmp_path, capsys):
  src = tmp_path / "hf"
  H.qwen3_moe(src, layers=2)
  capsys.readouterr()  # transformers' save progress
  w = str(tmp_path / "w")
  for name, changes, msg in (
      ("mid", {"mlp_only_layers": [1]}, "mlp_only_layers=[1] with decoder_sparse_step=1 is not supported"),
      ("sliding", {"use_sliding_window": True, "sliding_window": 0}, "sliding_window=0 is not supported; it must be "
                                                                      "an integer >= 1")):
    assert msg in _one_line_exit_2(capsys, ["import", str(_edited(src, tmp_path / name, **changes)), "--workdir", w])
  assert not (tmp_path / "w").exists()
  # A Mixtral export cannot hold unnormalized top-k weights (HF Mixtral always normalizes).
  with pytest.raises(UserError, match="moe_norm_top_k=False: a mixtral checkpoint cannot hold it"):
    hf.hf_config(config.load("moe-tiny", ["model.moe_norm_top_k=false"]), {}, "float32")
