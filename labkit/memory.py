"""What a stage holds in memory: its parameters, block by block, and the activations a microbatch leaves.

`param_groups` counts parameter elements per model block (which blocks a stage got from a manual
split or the tracer, notebooks 01 and 02); `saved_activation_bytes` measures what autograd keeps
for one microbatch until its backward (why 1F1B holds fewer microbatches than GPipe, notebook 04).
"""

from __future__ import annotations


def param_groups(module) -> dict[str, int]:
    """Parameter elements of `module` per owning block, in model order: `{"tok_embeddings": 2048, "layers.0": ...}`.

    A block is the first component of a parameter's name, plus the index when that component is a
    numbered container (`layers.0`); the names are those of the unsplit model, which a manual split
    and the tracer both keep (notebooks 01 and 02).
    """
    out: dict[str, int] = {}
    for name, p in module.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
        out[key] = out.get(key, 0) + p.numel()
    return out


def saved_activation_bytes(module, *inputs) -> int:
    """Bytes autograd saves for the backward during one forward of `module` on `inputs`.

    That is the activation memory one microbatch holds on a stage until its backward runs.
    Storages are counted once, and the module's own parameters (saved by e.g. Linear) are left
    out: they are there whatever the schedule does. Notebook 04.
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(seen.values())
