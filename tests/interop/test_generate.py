"""KV-cached generation: greedy ids equal `transformers` generate, the cache equals
recomputing the full forward, seeded sampling, and the CLI."""

import numpy as np
import pytest

pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from jaxtrain import generate
from jaxtrain.interop import decode
from jaxtrain.model import transformer as model_lib  # noqa: E402
from tests import hf_models as H  # noqa: E402
from tests.helpers import mesh_of  # noqa: E402

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 90]]  # different lengths: the second is left-padded


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  d = tmp_path_factory.mktemp("gen")
  ref = H.llama(d / "hf", rope_scaling=H.LLAMA3_ROPE)
  H.imported(d / "hf", d / "w")
  cfg, model, params = H.load(d / "w")
  return d, ref, (cfg, model, params)


def _generate(loaded, prompts, spec="fsdp=1", n=20, **kw):
  cfg, model, params = loaded
  return decode.generate(cfg, mesh_of(spec), nnx.split(model)[0], params, prompts, n, **kw)


def test_greedy_ids_equal_transformers_generate(llama):
  d, ref, _ = llama
  ours = _generate(H.load(d / "w", "fsdp=2,tp=2"), PROMPTS, "fsdp=2,tp=2")
  assert ours == H.transformers_greedy(ref, PROMPTS, 20)


def _full_forward_greedy(model, prompts, n):
  """Greedy decoding that recomputes the whole sequence every token (no cache): one jitted
  forward over a fixed length; the causal mask keeps the unfilled tail from mattering."""
  L = max(map(len, prompts)) + n
  fwd = nnx.jit(lambda m, t: m(t, np.broadcast_to(np.arange(L), t.shape), np.ones(t.shape, np.int32)))
  seq = np.zeros((len(prompts), L), np.int32)
  for b, p in enumerate(prompts):
    seq[b, :len(p)] = p
  for i in range(n):
    logits = np.asarray(fwd(model, seq))
    for b, p in enumerate(prompts):
      seq[b, len(p) + i] = int(np.argmax(logits[b, len(p) + i - 1]))
  return [seq[b, len(p):len(p) + n].tolist() for b, p in enumerate(prompts)]


@pytest.mark.parametrize("kind", ["llama", "mixtral_scanned"])
def test_kv_cache_equals_recomputing_the_full_forward(tmp_path, llama, kind):
  if kind == "mixtral_scanned":  # MoE blocks, stacked and run by jax.lax.scan
    H.mixtral(tmp_path / "hf")
    H.imported(tmp_path / "hf", tmp_path / "w", extra=["model.scan_layers=true"])
    loaded = H.load(tmp_path / "w")
  else:
    loaded = llama[2]
  cfg, model, _ = loaded
  ours = _generate(loaded, PROMPTS, n=12)
  assert ours == _full_forward_greedy(model, PROMPTS, 12)
  # The cached logits themselves: prompt in one pass, then token by token.
  seq = np.array([PROMPTS[0] + ours[0]])
  L = seq.shape[1]
  full = nnx.jit(lambda m, t: m(t, np.arange(L)[None], np.ones((1, L), np.int32)))(model, seq)
  cache = model_lib.init_cache(cfg.model, 1, L)
  parts, t = [], 7
  decode = nnx.jit(lambda m, *a: m.decode(*a))
  logits, cache = decode(model, seq[:, :t], np.arange(t)[None], np.ones((1, t), np.int32), cache)
  parts.append(logits)
  for i in range(t, L):
    logits, cache = decode(model, seq[:, i:i + 1], np.array([[i]]), np.ones((1, 1), np.int32), cache)
    parts.append(logits)
  np.testing.assert_allclose(np.concatenate(parts, 1), full, rtol=1e-5, atol=1e-5 * float(np.abs(full).max()))


def test_a_batch_that_does_not_split_over_the_mesh_is_padded(llama):
  """3 prompts on fsdp=8: padded to 8 rows, the padding never reaches the output, and each
  prompt's tokens are those of recomputing the full forward."""
  prompts = [*PROMPTS, [40, 41, 42, 43]]
  loaded = H.load(llama[0] / "w", "fsdp=8")
  ours = _generate(loaded, prompts, "fsdp=8", n=6)
  assert ours == _full_forward_greedy(loaded[1], prompts, 6)


def test_sampling_is_seeded_and_top_p_narrows_to_greedy(llama):
  loaded = llama[2]
  a = _generate(loaded, PROMPTS, temperature=1.0, seed=1)
  assert a == _generate(loaded, PROMPTS, temperature=1.0, seed=1)
  assert a != _generate(loaded, PROMPTS, temperature=1.0, seed=2)
  assert _generate(loaded, PROMPTS, temperature=1.0, top_p=1e-6, seed=3) == _generate(loaded, PROMPTS)


def test_cli_prints_the_ids_and_rejects_bad_flags(llama, run_cli, capsys):
  w = llama[0] / "w"
  r = run_cli("jaxtrain.generate", "--workdir", str(w), "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
              "--ignore-eos", "--mesh", "fsdp=1")
  assert r.returncode == 0, r.stderr[-1500:]
  assert r.stdout.strip() == ",".join(map(str, _generate(llama[2], [[5, 6, 7]], n=6)[0]))
  for argv, msg in ((["--top-p", "0"], "--top-p 0.0: must lie in (0, 1]"),
                    (["--prompt-ids", "5,999"], "each in [0, 96)")):
    with pytest.raises(SystemExit) as e:
      generate.main(["--workdir", str(w), "--prompt-ids", "1", *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and msg in err, err
