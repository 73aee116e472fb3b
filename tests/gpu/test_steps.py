"""jaxtrain's step at the suite's shape, each measurement in a child process (checks.py):
every `model.remat` policy, the `gpu-default` XLA flag preset with and without, and
jaxtrain against each baseline (rounds alternating, as `python -m jaxtrain.bench`)."""

import importlib.util
import math
import os
import typing

import pytest

_steps: dict = {}  # (remat, extra XLA_FLAGS) -> figures: the remat none step is measured once


def remat_policies() -> tuple[str, ...]:
  from jaxtrain.core.config import ModelConfig
  return typing.get_args(typing.get_type_hints(ModelConfig)["remat"])


def _step(child, remat: str, flags: tuple[str, ...] = ()) -> dict:
  if (remat, flags) not in _steps:
    env = {"XLA_FLAGS": " ".join([*os.environ.get("XLA_FLAGS", "").split(), *flags])} if flags else None
    _steps[remat, flags] = child("step", remat, env)
  return _steps[remat, flags]


def _ms(st) -> str:
  return f"{st['median'] * 1e3:.2f} ms"


@pytest.mark.parametrize("remat", remat_policies())
def test_step_with_each_remat_policy_keeps_a_finite_loss(remat, child, report):
  r = _step(child, remat)
  report[f"remat_{remat}"] = r
  cm, peak = r["compiled_memory_bytes"], r["peak_memory_bytes"]
  gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
  print(f"remat_{remat}: {_ms(r['step_time_s'])}, {r['tokens_per_s']:,.0f} tokens/s, peak {gib(peak)}, "
        f"compiled temp {gib(cm and cm['temp'])}, attention {r['attention']}")
  assert r["remat"] == remat and r["step_time_s"]["median"] > 0
  assert math.isfinite(r["loss_after"]), f"loss is {r['loss_after']} after {r['steps_before_loss']} steps"


def test_gpu_default_xla_flags_with_and_without(child, report):
  from jaxtrain.parallel import xla_flags
  have = os.environ.get("XLA_FLAGS", "").split()
  taken = {xla_flags.name_of(f) for f in have}
  preset = xla_flags.PRESETS["gpu-default"]
  kept, dropped = xla_flags.validate([f for f in preset if xla_flags.name_of(f) not in taken])
  without = _step(child, "none")  # the remat_none test's run when it ran first
  with_ = _step(child, "none", tuple(kept))
  ratio = with_["step_time_s"]["median"] / without["step_time_s"]["median"]
  report["xla_flags"] = {"preset": "gpu-default", "accepted": kept, "dropped": dropped,
                         "already_in_XLA_FLAGS": [f for f in preset if xla_flags.name_of(f) in taken],
                         "with": with_, "without": without, "step_time_ratio_with_over_without": ratio}
  print(f"xla_flags: {len(kept)} accepted, {len(dropped)} dropped ({' '.join(dropped) or 'none'}); step "
        f"{_ms(without['step_time_s'])} without, {_ms(with_['step_time_s'])} with ({ratio:.3f}x)")
  # The child with the preset ran with the accepted flags in force; the other without them.
  assert set(kept) <= set(with_["xla_flags"].split())
  assert not set(kept) & set(without["xla_flags"].split())
  assert math.isfinite(with_["loss_after"]) and math.isfinite(without["loss_after"])


@pytest.mark.parametrize("name", ["minimal", "torch"])
def test_jaxtrain_against_baseline(name, child, device, tiny, report):
  if name == "torch" and importlib.util.find_spec("torch") is None:
    pytest.skip("torch not installed")
  if name == "torch" and device.platform == "cpu":  # JAXTRAIN_GPU_TESTS=tiny on a CPU
    pytest.skip("torch.compile on a CPU takes minutes (tests/analysis/test_baselines.py checks the torch baseline there)")
  from tests.gpu import checks
  r = child("baseline", name)
  report[f"baseline_{name}"] = r
  q, s = r["ratio"], checks.shape(tiny)
  print(f"baseline_{name}: jaxtrain {_ms(r['jaxtrain']['step_time_s'])}, {name} {_ms(r['baseline']['step_time_s'])}; "
        f"jaxtrain/{name} tokens/s {q['median']:.3f}x over {q['n']} round(s)")
  assert r["batch"] == "one document per row" and r["rounds"] == s["rounds"]
  for side in (r["jaxtrain"], r["baseline"]):
    assert side["step_time_s"]["n"] == s["steps"] * s["rounds"] and side["step_time_s"]["min"] > 0
  assert len(q["per_round"]) == s["rounds"] and all(math.isfinite(x) and x > 0 for x in q["per_round"])
