"""Reference answers for notebook 01's exercises (look only after trying)."""

import torch

from labkit.notebook import param_groups
from labkit.stages import manual_stage_module


def stage1_of_4(full) -> list[str]:
    """Exercise 1: 8 layers in 4 stages are 2 layers each; stage 1 holds layers 2 and 3 and nothing else."""
    return list(param_groups(manual_stage_module(full, 1, 4)))


def activation_shape(stage0, x) -> tuple:
    """Exercise 2: one microbatch of 8 // 2 = 4 sequences, after stage 0: (seq, microbatch, dim) = (8, 4, 32)."""
    with torch.no_grad():
        return tuple(stage0(x.chunk(2)[0]).shape)


def split_point_for_3_layers() -> str:
    """Exercise 3: stage 1 begins at layers.3, so stage 0 holds layers 0, 1 and 2."""
    return "layers.3"
