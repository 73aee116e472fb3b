"""The bundled demo corpus (bundled.jsonl) that the default config trains on; generate.py rebuilds it."""
