"""Whether `check_step` fits before it starts: what its references hold on a rank, against what the rank
has free, so that a model too large for it gets the estimate and the pointer to `check_stages` (which
holds each rank's slices only), never an out-of-memory kill halfway through.

check_step holds, beside the caller's own unsplit model, a copy of it and its gradients (the whole-
batch reference), the microbatched reference's gradients, a float64 copy and its gradients (the truth):
per floating parameter element 3 times its own bytes and 16 bytes, 7 times the model's float32 bytes,
before any activation (the estimate is a lower bound; the check says so). Free: the device's free
memory on a GPU (torch.cuda.mem_get_info), else MemAvailable of /proc/meminfo shared by the ranks of this
machine (LOCAL_WORLD_SIZE: every rank runs its check at once).

May import: torch."""

from __future__ import annotations

import os

import torch


def need_bytes(full: torch.nn.Module) -> int:
    """The bytes check_step's references hold on a rank for the unsplit model `full`, activations aside."""
    return sum(3 * p.numel() * p.element_size() + 16 * p.numel() for p in full.parameters() if p.is_floating_point())


def free_bytes(device) -> int | None:
    """What this rank may use: a GPU's free memory, or this machine's available memory over its ranks;
    None where it cannot be read (then nothing is refused)."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001
            return None
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kb * 1024 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))


def too_large(full: torch.nn.Module, device) -> str:
    """'' when check_step's references fit on this rank; else the sentence that says why not and what to do."""
    need, free = need_bytes(full), free_bytes(device)
    if free is None or need <= free:
        return ""
    gib = lambda n: f"{n / 2 ** 30:.2f} GiB"  # noqa: E731
    where = "free on its GPU" if torch.device(device).type == "cuda" else "available to it (this machine's " \
        "available memory over its ranks)"
    held = sum(p.numel() * p.element_size() for p in full.parameters())
    return (f"check_step needs at least {gib(need)} on each rank for this model (whose parameters hold {gib(held)}: "
            f"a copy, a float64 copy and three references' gradients, before their activations) and a rank has "
            f"{gib(free)} {where}: check this step with labkit.worker.check_stages, which holds only each rank's "
            f"slices of the model (notebook 09b), or check a smaller configuration of the same code.")
