"""Checkpoints -> hooked models: `from_pretrained(path_or_repo_id)` and `from_hf(hf_model)`."""

from loaders.load import CheckpointError, from_hf, from_pretrained, from_pretrained_no_processing
from loaders.safetensors_io import CheckpointFileError

__all__ = ["from_pretrained", "from_pretrained_no_processing", "from_hf", "CheckpointError", "CheckpointFileError"]
