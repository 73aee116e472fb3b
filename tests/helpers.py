"""Shared test helpers: build a mesh from a spec on the first N simulated devices."""

import math

import jax

from jaxtrain import mesh as mesh_lib


def mesh_of(spec: str):
  sizes = mesh_lib.parse(spec)
  return mesh_lib.build(sizes, jax.devices()[:math.prod(sizes.values())])
