"""Checkpoints: megatron dist-ckpt save/resume (atomic, verified), HF export."""

from .dist_ckpt import (CheckpointError, find_latest, list_checkpoints, load_checkpoint,  # noqa: F401
                        save_checkpoint, verify_checkpoint)
