"""Real-GPU measurements (issue #26)."""
