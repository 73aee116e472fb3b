"""Checkpoints with sliding windows in and out of Hugging Face: Mistral (every layer local) and Qwen3 with
use_sliding_window (its layers from max_window_layers on local) import with their windows, give the logits of
`transformers` after import and after export, and generate its greedy tokens through the windowed KV cache."""

import copy

import pytest

pytest.importorskip("transformers")

from tests import hf_models as H  # noqa: E402
from tests.interop.test_generate import _generate  # noqa: E402
from tests.interop.test_hf import IDS  # noqa: E402

pytestmark = pytest.mark.slow  # whole-model compiles

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 90]]  # the first longer than the window
# family -> (builder, the mesh, the windows jaxtrain must read)
FAMILIES = {"mistral": (lambda p: H.mistral(p, window=5), "fsdp=2,tp=2", (5, 5)),
            "qwen3": (lambda p: H.qwen3(p, use_sliding_window=True, sliding_window=4, max_window_layers=1),
                      "fsdp=1", (0, 4))}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
  build, spec, windows = FAMILIES[request.param]
  d = tmp_path_factory.mktemp(request.param)
  ref = build(d / "hf")
  H.imported(d / "hf", d / "w", spec)
  return d, ref, spec, windows, H.load(d / "w", spec)


def test_windowed_checkpoints_import_and_export_with_the_logits_of_transformers(imported, tmp_path):
  d, ref, spec, windows, (cfg, model, _) = imported
  assert cfg.model.layer_windows() == windows
  theirs = H.torch_logits(ref, IDS)
  c = copy.deepcopy(ref.config)  # the same weights without the window
  c.sliding_window, c.layer_types = None, ["full_attention"] * c.num_hidden_layers
  full = type(ref)(c).eval()
  full.load_state_dict(ref.state_dict())
  assert H.rel_err(H.torch_logits(full, IDS), theirs) > 1e-2  # the window matters at these 24 positions
  assert H.rel_err(H.jax_logits(model, IDS), theirs) < 1e-5
  H.exports_back(d, spec, tmp_path / "out", ref, theirs, IDS)


def test_greedy_generation_through_the_windowed_cache_equals_transformers(imported):
  d, ref, spec, windows, loaded = imported
  assert _generate(loaded, PROMPTS, spec) == H.transformers_greedy(ref, PROMPTS, 20)
