"""Hugging Face checkpoints in and out, and KV-cached generation from a checkpoint.

May import core, model, parallel, run and data; never a command."""
