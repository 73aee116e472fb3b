"""jaxtrain: a JAX/XLA trainer for decoder-only transformers on one logical mesh."""

__version__ = "0.1.0"
