"""Tiny random-weight model factories (no hub access needed)."""
