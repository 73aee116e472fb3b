"""Baselines for `python -m jaxtrain.bench`, the same model and batch written as a user would:
minimal.py (plain `jax.jit`), torch_model.py (PyTorch); both start from jaxtrain's parameters."""


def layer_list(params: dict, n_layers: int) -> dict:
  """`params` with layers indexed one by one (`params["layers"][i]`), as the baselines read them;
  scanned parameters (each leaf stacked on a leading layer axis) are split."""
  layers = params["layers"]
  if all(isinstance(k, int) for k in layers):
    return params
  import jax
  return {**params, "layers": {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n_layers)}}
