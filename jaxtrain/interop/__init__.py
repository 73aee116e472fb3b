"""Hugging Face checkpoints in and out, KV-cached generation from a checkpoint, and lm-eval-harness tasks on the model.

May import core, model, parallel, run and data; never a command."""
