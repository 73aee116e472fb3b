"""Baselines for `python -m jaxtrain.bench`: the same model and batch, written as a user would.

minimal: one plain `jax.jit` train step (no sharding, no Setup). torch: PyTorch with
torch.compile and SDPA. Both start from jaxtrain's initial parameters (a pure dict).
"""
