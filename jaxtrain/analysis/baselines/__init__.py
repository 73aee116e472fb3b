"""Baselines for `python -m jaxtrain.bench`: the same model and batch, written as a user would.

minimal: one plain `jax.jit` train step (no sharding, no Setup). torch: PyTorch with
torch.compile and SDPA. Both start from jaxtrain's initial parameters (a pure dict).
"""


def layer_list(params: dict, n_layers: int) -> dict:
  """The baselines index layers one by one (`params["layers"][i]`); scanned parameters
  (model.scan_layers: each leaf stacked on a leading layer axis) are split into that form."""
  layers = params["layers"]
  if all(isinstance(k, int) for k in layers):
    return params
  import jax
  return {**params, "layers": {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n_layers)}}
