"""Run as each of N processes: writes the rows of the first global batch this process feeds."""

import argparse
import sys

import numpy as np

from jaxtrain import data
from jaxtrain.core import config
from jaxtrain.parallel import distributed
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.run import step


def main():
  p = argparse.ArgumentParser()
  for flag in ("--mesh", "--coordinator", "--out"):
    p.add_argument(flag)
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  a = p.parse_args()
  cfg = config.load("tiny")
  sizes, dcn = mesh_lib.parse_full(a.mesh)
  distributed.initialize(distributed.cluster_from(a.coordinator, a.num_processes, a.process_id), sizes, 30, 60)
  setup = step.Setup(cfg, mesh_lib.build(sizes, dcn=dcn))
  block, blocks = setup.placement.rows()
  it = data.batches(cfg, block, blocks)
  np.save(f"{a.out}.p{a.process_id}.npy", next(it)["inputs"])
  it.close()
  print("rows", block, blocks, flush=True)


if __name__ == "__main__":
  sys.exit(main())
