"""Whether `check_step` fits before it starts: what its references hold on a rank, against what the rank
has free, so that a model too large for it gets the estimate and the pointer to `check_stages` (which
holds each rank's slices only), never an out-of-memory kill halfway through.

check_step holds, beside the caller's own unsplit model, a copy of it and its gradients (the whole-
batch reference), the microbatched reference's gradients, a float64 copy and its gradients (the truth):
per floating parameter element 3 times its own bytes and 16 bytes, 7 times the model's float32 bytes,
before any activation (the estimate is a lower bound; the check says so). Free: the device's free
memory on a GPU (torch.cuda.mem_get_info), else MemAvailable of /proc/meminfo shared by the ranks of this
machine (LOCAL_WORLD_SIZE: every rank runs its check at once).

A failed check_stages places the bug by replaying each stage in float64 beside its slice
(labkit.check.boundaries): `replay_too_large` says before a replay starts when it cannot fit, and the
verdict then stands without the module named, never an out-of-memory kill.

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
            f"{gib(free)} {where}: check this step with labkit.check_stages, which holds only each rank's "
            f"slices of the model (notebook 09b), or check a smaller configuration of the same code.")


def replay_need_bytes(modules: list, activation: torch.Tensor | None = None) -> int:
    """What the float64 replay of one stage beside its slice holds (labkit.check.boundaries): two float64
    copies and their gradients, 32 bytes a floating parameter element, and every module's input and output
    recorded for both, taken as 4 tensors of the stage's input `activation` (float64) a module (a lower
    bound where a layer widens it: an MLP)."""
    params = sum(32 * p.numel() for m in modules for p in m.parameters() if p.is_floating_point())
    n_modules = sum(len(list(m.modules())) for m in modules)
    act = 4 * 8 * activation.numel() * n_modules if torch.is_tensor(activation) else 0
    return params + act


def replay_too_large(modules: list, activation, device) -> str:
    """'' when the replay of a stage fits on this rank; else why not, in the words of a Departure's detail."""
    need, free = replay_need_bytes(modules, activation), free_bytes(device)
    if free is None or need <= free:
        return ""
    size = lambda n: f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"  # noqa: E731
    return (f"its replay needs about {size(need)} on this rank, float64 copies of the stage and of its "
            f"slice, their gradients and every module's activations, and it has {size(free)} available: "
            "the verdict stands; to place the bug by module, check a smaller configuration of the same code (fewer "
            "layers a stage, a shorter batch) where it shows too")
