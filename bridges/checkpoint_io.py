"""mbridge reads HF weights through the project's reader, so the trainer's load takes a
checkpoint in either expert layout (fused 3-D experts, as Qwen3.5-MoE releases store them, or
one tensor per expert): mix `ReadsEitherExpertLayout` in before an mbridge bridge class.

In:  the checkpoint dir mbridge's load_weights is given. Out: a checkpoint.hf_reader.HFReader
     in place of mbridge's SafeTensorIO (same two calls; fused experts answered as their
     per-expert slices, checkpoint/expert_layout.py).
"""

from __future__ import annotations

from skyrl_mega.checkpoint.hf_reader import HFReader


class ReadsEitherExpertLayout:
    def _get_safetensor_io(self, weights_path: str) -> HFReader:
        return HFReader(self._get_actual_hf_path(weights_path))
