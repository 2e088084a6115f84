"""Prompt datasets, the demo's synthetic task, and reward functions."""
