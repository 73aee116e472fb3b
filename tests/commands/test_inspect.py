"""`python -m jaxtrain.inspect`: FLOPs, compiled memory against the bill, warnings, the CLI."""

import json
import subprocess
import sys

import pytest

from jaxtrain.analysis import report
from jaxtrain.core import config
from jaxtrain.model import flops
from tests.helpers import clean_env, mesh_of

pytestmark = pytest.mark.slow  # compiles of whole steps, subprocesses: left out of -m 'not slow'

# The ratio compiled/analytic total that the README documents as agreement (XLA fuses
# and reuses buffers the formula counts separately; measured 0.88-1.08 on tiny, 0.76 on
# llama3-8b at fsdp=8,tp=8).
RATIO = (0.7, 1.3)


def test_flops_per_token_match_a_hand_computation():
  rep = report.report(config.load("tiny"), mesh_of("dp=2"), "tiny")
  # tiny: D=128, H=8, K=4, E=16, F=256, V=512, 2 layers, L=128.
  attn = 128 * 16 * (8 + 4 + 4 + 8)   # wq, wk, wv, wo
  mlp = 3 * 128 * 256                 # gate, up, down
  weights = 2 * (attn + mlp) + 128 * 512  # + LM head; the embedding lookup is no matmul
  forward = 2 * weights + 2 * (2 * 2 * 128 * 8 * 16) / 2  # QK^T and PV per layer, causal half
  assert rep["flops"]["per_token"] == 3 * forward == 2_359_296
  assert rep["flops"]["per_step"] == 3 * forward * 16 * 128


@pytest.mark.parametrize("spec, sets", [("fsdp=2,tp=2", ["train.microbatches=2"]), ("sp=2,dp=2", [])])
def test_compiled_memory_agrees_with_the_bill(spec, sets):
  rep = report.report(config.load("tiny", sets), mesh_of(spec), "tiny", compile=True)
  c = rep["compiled"]
  assert c["available"]
  assert c["arguments"] == c["analytic"]["arguments"]  # the state and batch, byte for byte
  assert RATIO[0] <= c["ratio"] <= RATIO[1], c


def test_replication_warning_fires_for_large_replicated_params():
  cfg = config.load("llama3-1b", ["model.scan_layers=false"])  # one row per repeated layer
  warned = report.report(cfg, mesh_of("dp=8"), "llama3-1b")["warnings"]
  assert any(w.startswith("embed: 1002.0 MiB per device, fully replicated on all 8 devices; a mesh with fsdp or expert or "
                          "tensor > 1 would shard it") for w in warned), warned
  assert any(w.startswith("layers/*/mlp/w_up (x16): 64.0 MiB") for w in warned), warned
  assert report.report(cfg, mesh_of("fsdp=8"), "llama3-1b")["warnings"] == []
  assert report.report(cfg, mesh_of("dp=1"), "llama3-1b")["warnings"] == []  # one device: nothing could shard it


def test_cli_json_for_llama3_8b_on_64_devices(run_cli):
  r = run_cli("jaxtrain.inspect", "--config", "llama3-8b", "--mesh", "fsdp=8,tp=8", "--device-memory", "80GiB", "--json")
  assert r.returncode == 0, r.stderr[-2000:]
  rep = json.loads(r.stdout)
  assert rep["param_count"] == 8_030_261_248 and rep["devices"] == 64
  assert rep["param_bytes_per_device"] == sum(p["bytes"] * p["count"] for p in rep["params"])
  assert rep["flops"]["per_token"] == flops.flops_per_token(config.load("llama3-8b").model, 8192)
  mem = rep["memory"]
  assert mem["total"] == sum(mem["items"].values()) and mem["fits"] is False
  assert mem["verdict"].startswith("does not fit: misses by") and "largest: activations" in mem["verdict"]
  assert set(rep["comms"]) == {"fsdp", "tensor"}


def test_cli_text_shows_table_bill_and_notes(run_cli):
  r = run_cli("jaxtrain.inspect", "--mesh", "dp=8,tp=8")
  assert r.returncode == 0, r.stderr[-2000:]
  out = r.stdout
  assert "path" in out and "PartitionSpec" in out and "bytes/device" in out
  assert "total: 426,624 parameters" in out and "verdict: no device memory known" in out
  assert "note: layers/*/attn/wk: kv_heads=4 is smaller than tensor=8; replicated over tensor" in out
  assert "(x2)" in out  # the note about both layers, once


@pytest.mark.parametrize("args, words", [
    (["--mesh", "tp=3"], ["tensor=3 can neither split nor evenly replicate", "sizes that work for every parameter"]),
    (["--device-memory", "lots"], ["--device-memory 'lots'", "known device kind"]),
    (["--warn-replicated", "big"], ["--warn-replicated 'big' is not a size"]),
])
def test_bad_input_gives_one_line(run_cli, args, words):
  r = run_cli("jaxtrain.inspect", *args)
  assert r.returncode == 2, (r.stdout, r.stderr)
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxtrain.inspect: error:"), r.stderr
  for w in words:
    assert w in lines[0]


PODS = [("llama3.1-8b", "host8"), ("llama3.1-70b", "pod-8x8-fsdp"), ("mixtral-8x7b", "pod-8x8-moe")]


POD_SCRIPT = """
import json, math
import jax
jax.config.update("jax_num_cpu_devices", 64)
from jaxtrain.analysis import report
from jaxtrain.core import config
from jaxtrain.parallel import mesh as mesh_lib
out = {}
for name, spec in %r:
  sizes, _ = mesh_lib.parse_full(spec)  # dcn factors only order devices; one process here
  m = mesh_lib.build(sizes, jax.devices()[:math.prod(sizes.values())])
  rep = report.report(config.load(name), m, name, device_memory="H100", device="H100")
  out[name] = {k: rep["memory"][k] for k in ("fits", "verdict", "attention", "total", "device_memory")}
print(json.dumps(out))
"""


def test_inspect_device_h100_says_fits_for_each_pod_preset():
  """Analytic: the pod meshes (8 and 64 devices) on simulated devices, bill for H100 kernels."""
  rep = report.report(config.load("llama3.1-8b"), mesh_of("fsdp=8"), "llama3.1-8b", device_memory="H100",
                       device="H100")
  text = report.render(rep)
  assert "Memory per device (analytic, for H100: attention cudnn, remat save_dots)" in text
  # the cuDNN path for the preset's own data (the bundled corpus, packed): offsets sized from its rows
  assert "  attention: cuDNN fused attention (causal; segments as packed offsets, at most " in text
  assert "per row (the data's rows))" in text
  assert "verdict [H100]: fits:" in text and rep["memory"]["total"] < 0.9 * 80 * 2**30
  # the 64-device meshes need a process of their own
  p = subprocess.run([sys.executable, "-c", POD_SCRIPT % (PODS[1:],)], capture_output=True, text=True, timeout=300,
                     env=clean_env(JAX_PLATFORMS="cpu"))
  assert p.returncode == 0, p.stderr[-2000:]
  got = json.loads(p.stdout.strip().splitlines()[-1])
  for name, _ in PODS[1:]:
    mem = got[name]
    assert mem["attention"] == "cudnn" and mem["device_memory"] == 80 * 2**30
    assert mem["fits"] and mem["verdict"].startswith("fits:"), (name, mem)
    assert mem["total"] < 0.9 * 80 * 2**30, (name, mem["total"] / 2**30)  # with a margin


def test_unknown_device_is_one_line_naming_the_known_ones(run_cli):
  r = run_cli("jaxtrain.inspect", "--config", "tiny", "--mesh", "dp=1", "--device", "Z100")
  assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
  assert "'Z100' is not a known device; known: H200, H100" in r.stderr
