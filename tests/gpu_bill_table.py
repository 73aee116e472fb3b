"""The README's table "bill vs XLA:GPU compile": llama3-8b (32 scanned layers), one
sequence per GPU on 8 H100s (fsdp=8), every remat policy, cuDNN and reference attention,
seq 2048 and 8192. Compile-only (needs the gpu-aot extra; about a minute per row on 2 cores):

    JAX_PLATFORMS=cpu python tests/gpu_bill_table.py [2048 8192]
"""

import sys

import jax

jax.config.update("jax_platforms", "cpu")

from jaxtrain.core import config
from jaxtrain.analysis import gpu_compile
from jaxtrain.analysis import memory
from jaxtrain.run import step  # noqa: E402

BASE = ["model.scan_layers=true", "train.batch_size=8", "model.attention_max_segments=16"]


def row(mesh, sets):
  setup = step.Setup(config.load("llama3-8b", BASE + sets), mesh)
  b = memory.bill(setup, memory.grouped(memory.param_rows(setup)), 0.0)
  i = b.items
  args = i["params"] + i["adam_m"] + i["adam_v"] + i["counters"] + i["batch"]
  compiled, seconds = gpu_compile.compile_step(setup)
  m = gpu_compile.CompiledMemory.of(compiled)
  return setup.plan.attention, m.arguments == args, m.total - m.generated_code, b.total, seconds


def main(seqs):
  mesh = gpu_compile.mesh("H100", "fsdp=8")
  print("| seq | attention | remat | compiled GiB | bill GiB (no margin) | compiled / bill | arguments equal |")
  print("|---|---|---|---|---|---|---|")
  for seq in seqs:
    for kernel in ("cudnn", "xla"):
      for remat in ("none", "full", "save_dots", "save_named", "offload_named"):
        k, same, c, b, _ = row(mesh, [f"train.seq_len={seq}", f"model.attention={kernel}", f"model.remat={remat}"])
        print(f"| {seq} | {'cuDNN' if k == 'cudnn' else 'reference'} | {remat} | {c / 2**30:.2f} | {b / 2**30:.2f} "
              f"| {c / b:.3f} | {same} |", flush=True)


if __name__ == "__main__":
  main([int(a) for a in sys.argv[1:]] or [2048, 8192])
