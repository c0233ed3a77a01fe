"""Official Ling-3 checkpoints <-> ling-jax params: name table (`hf`), streaming loader (`load`), orbax
checkpoints (`orbax_io`) and random checkpoints in the official layout (`synthetic`)."""

from conversion.load import CheckpointError, load_hf
from conversion.orbax_io import convert, load_params, save_params
from conversion.synthetic import write_synthetic

__all__ = ["CheckpointError", "convert", "load_hf", "load_params", "save_params", "write_synthetic"]
