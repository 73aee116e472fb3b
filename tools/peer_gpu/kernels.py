"""Kernel by kernel, the roofline time of two one-device train steps: jaxtrain's llama3-1b step at the GPU kit's
shape and math (batch 4 x 2048, one document per row, bf16 head logits, remat save_dots unless overridden),
compiled here for one compile-only H100, beside a MaxText step saved by run_case.sh (res/CASE.hlo.gz).

usage: PYTHONPATH=<jaxtrain tree> python kernels.py MT_CASE [--device H200] [--set KEY=VALUE ...]

Each kernel's time is jaxtrain.analysis.overlap.Costs' roofline (max of matmul FLOPs over the bf16 peak and HBM
bytes over the bandwidth of the --device row) times its executions per step; kernels are grouped by the primitive
that names them (the op_name's last part). A prediction of what the program asks of the device: which GEMM or
cuDNN kernel runs, and how close it comes to its roofline, only a GPU profile shows.
"""
import argparse, collections, gzip, os, re, sys

from jaxtrain.analysis import gpu_compile, overlap
from jaxtrain.core import config
from jaxtrain.parallel import devices
from jaxtrain.run import step as step_lib

P = os.environ.get("P", os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxtrain-gpupeer"))
KIT = ["train.seq_len=2048", "train.batch_size=4", "model.remat=save_dots", "model.head_logits_dtype=bfloat16"]


def kernels(text: str, row) -> list[tuple[str, float, float, float]]:
  """(group, seconds, bytes, flops) per kernel per step: loop bodies times their trip counts."""
  hlo = gpu_compile.Hlo.parse(text)
  costs = overlap.Costs(hlo, row)
  out = []

  def walk(comp, times):
    for i in costs.by_comp.get(comp, ()):
      if i.opcode == "while":
        body, trip = costs.loop(i)
        walk(body, times * trip)
      elif i.opcode in ("call", "conditional"):
        if b := costs.branch(i):
          walk(b, times)
      elif s := costs.seconds(i):
        out.append((group(i), s * times, costs.nbytes(i) * times, costs.flops(i) * times))

  walk(hlo.instrs[-1].computation, 1)  # the entry computation comes last in XLA's text
  return out


def group(i) -> str:
  target = re.search(r'custom_call_target="([^"]+)"', i.rest)
  if target:
    return "cuDNN attention" if "fmha" in target.group(1) else target.group(1)
  name = re.search(r'op_name="([^"]*)"', i.rest)
  prim = name.group(1).rsplit("/", 1)[-1] if name else i.name.rstrip(".0123456789")
  return f"{prim} ({'matmul' if 'dot' in prim or 'gemm' in i.name else i.name.split('_')[0]})"


def jaxtrain_step(sets: list[str]) -> str:
  cfg = config.load("llama3-1b", [*KIT, *sets])
  setup = step_lib.Setup(cfg, gpu_compile.mesh("H100", "fsdp=1"), segments=1)  # one document per row
  print("jaxtrain plan:", setup.plan.describe(), file=sys.stderr)
  return gpu_compile.compile_step(setup)[0].as_text()


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("case")
  ap.add_argument("--device", default="H200")
  ap.add_argument("--set", action="append", default=[])
  a = ap.parse_args()
  row = devices.TABLE[a.device]
  sides = {"jaxtrain": kernels(jaxtrain_step(a.set), row),
           "MaxText": kernels(gzip.open(f"{P}/res/{a.case}.hlo.gz", "rt").read(), row)}
  for name, ks in sides.items():
    mm = sum(s for _, s, _, f in ks if f)
    print(f"{name}: {sum(s for _, s, _, _ in ks) * 1e3:.2f} ms on a {a.device} at roofline: kernels with matmuls "
          f"{mm * 1e3:.2f} ms ({sum(f for *_, f in ks) / 1e12:.1f} TFLOP), the rest {(sum(s for _, s, _, _ in ks) - mm) * 1e3:.2f} "
          f"ms ({sum(b for _, _, b, f in ks if not f) / 1e9:.1f} GB), {len(ks)} kernels")
  by = {n: collections.Counter() for n in sides}
  for n, ks in sides.items():
    for g, s, _, _ in ks:
      by[n][g] += s * 1e3
  names = sorted(set(by["jaxtrain"]) | set(by["MaxText"]), key=lambda g: -max(by["jaxtrain"][g], by["MaxText"][g]))
  print(f"{'ms per step, grouped by primitive':60s} {'jaxtrain':>9s} {'MaxText':>9s}")
  for g in names[:40]:
    print(f"{g[:60]:60s} {by['jaxtrain'][g]:9.2f} {by['MaxText'][g]:9.2f}")


if __name__ == "__main__":
  main()
