"""Reference answers for notebook 01's exercises (look only after trying)."""


def stage1_of_4() -> list[str]:
    """Exercise 1: 8 layers in 4 stages are 2 layers each (0-1, 2-3, 4-5, 6-7). Stage 1 is neither the
    first (no embedding) nor the last (no norm, no output): it holds layers 2 and 3 and nothing else."""
    return ["layers.2", "layers.3"]


def activation_shape(cfg, n_microbatches: int) -> tuple:
    """Exercise 2: a microbatch holds batch_size // n_microbatches sequences (8 // 2 = 4). After the
    embedding, the kit's batch layout transposes to (seq, batch, dim): (16, 4, 32) for the tiny preset."""
    p = cfg.model
    return (p.seq_len, cfg.batch_size // n_microbatches, p.dim)


def split_point_for_3_layers() -> str:
    """Exercise 3: stage 1 begins at layers.3, so stage 0 holds layers 0, 1 and 2."""
    return "layers.3"


def one_f_one_b(module, rank, world_size, device, example, n_microbatches, loss_fn):
    """Exercise 4 (runs on every rank): a fresh PipelineStage of this rank's piece, driven by 1F1B.
    Only the schedule class changes; the stage and the step calls are those of GPipe."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(module, stage_index=rank, num_stages=world_size, device=device, input_args=example)
    return stage, Schedule1F1B(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
