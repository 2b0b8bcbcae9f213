"""Reference answers for notebook 11's exercises (look only after trying)."""


def tied_ranks() -> dict[str, list[int]]:
    """Exercise 1: the tied matrix is used by the first stage (the embedding) and the last (lm_head),
    stages 0 and 3. A loop places stages 0, 2 on rank 0 and 1, 3 on rank 1: two ranks hold a copy,
    an all-reduce between them. A V places 0, 3 on rank 0 and 1, 2 on rank 1: one rank holds both
    copies, and the sum is a local addition, no communication."""
    return {"Interleaved1F1B": [0, 1], "ZBVZeroBubble": [0]}


def balanced_bounds() -> list[int]:
    """Exercise 2: the last unit alone costs 7 ms, so no cut beats a slowest stage of 7. The last stage
    must then be unit 9 alone (any unit more makes it 8), and units 0-8 (11 ms) go on two stages of at
    most 7 each: [0, 4) = 3+1+1+1 = 6 and [4, 9) = 5. [0, 3, 9, 10] (5, 6, 7) and [0, 5, 9, 10]
    (7, 4, 7) are as good; the even split [0, 3, 7, 10] (5, 4, 9) has a slowest stage of 9."""
    return [0, 4, 9, 10]


def uneven_llama(stage_class, llama, rank, world_size, device, loss_fn):
    """Exercise 3 (runs on every rank): the notebook's LlamaStage with bounds [0, 1, 4], a fresh
    PipelineStage, and GPipe over 2 microbatches with the kwargs cut along the batch."""
    import copy

    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    bounds = [0, 1, 4]
    module = stage_class(copy.deepcopy(llama), bounds[rank], bounds[rank + 1])
    stage = PipelineStage(module, stage_index=rank, num_stages=world_size, device=device)
    spec = {"attention_mask": TensorChunkSpec(0), "position_ids": TensorChunkSpec(0)}
    return stage, ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn, kwargs_chunk_spec=spec)
