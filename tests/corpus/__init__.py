"""Tests of the bundled corpus."""
