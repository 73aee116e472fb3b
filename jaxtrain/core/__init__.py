"""The base layer: typed config and presets, user-facing errors, crash-safe file helpers.

Imports nothing else of jaxtrain; every other package may import it."""
