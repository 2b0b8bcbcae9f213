"""Whether `check_step` fits before it starts: what its references hold on a rank, against what the rank
has free, so that a model too large for it gets the estimate and the pointer to `check_stages` (which
holds each rank's slices only), never an out-of-memory kill halfway through.

check_step holds, beside the caller's own unsplit model, a copy of it and its gradients (the whole-
batch reference), the microbatched reference's gradients, a float64 copy and its gradients (the truth):
per floating parameter element 3 times its own bytes and 16 bytes, 7 times the model's float32 bytes,
before any activation (the estimate is a lower bound; the check says so). Free: the device's free
memory on a GPU (torch.cuda.mem_get_info), else MemAvailable of /proc/meminfo shared by the ranks of this
machine (LOCAL_WORLD_SIZE: every rank runs its check at once).

`check_stages` holds, beyond the slices the user built, one reference's gradients of them at a time (C's sums)
and R's as it makes them, and T's float64 copy of one module with its gradients (float32 for a 16-bit step):
`stages_need_bytes`, refused up front by `stages_too_large` as check_step is. `labkit.watch_run` holds check_step's
references and its own copy of the unsplit model on the device (with slices=, check_stages' need beside the
rank's slices instead), and on the host each checked step's anchor (the rank's weights and optimizer state) and
the gradients of every step since it (`every` of them): `watch_too_large`, said before the run starts.

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


def _size(n: int) -> str:
    if n < 2 ** 20:
        return f"{n / 2 ** 10:.1f} KiB"
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def _where(device) -> str:
    return "free on its GPU" if torch.device(device).type == "cuda" else "available to it (this machine's " \
        "available memory over its ranks)"


def stages_need_bytes(slices: dict, sixteen: bool = False) -> int:
    """check_stages' bytes on a rank beyond its `slices` ({stage: module}), activations aside (a lower bound):
    two gradients of every slice in its own dtype (C's sums, R's as made), and T's copy of the largest module
    that holds parameters directly, with its gradients (8 + 8 bytes an element; 4 + 4 for a 16-bit step)."""
    params = [p for m in slices.values() for p in m.parameters() if p.is_floating_point()]
    own = sum(p.numel() * p.element_size() for p in params)
    block = max((sum(p.numel() for p in m.parameters(recurse=False) if p.is_floating_point())
                 for sl in slices.values() for m in sl.modules()), default=0)
    return 2 * own + block * (8 if sixteen else 16)


def stages_too_large(slices: dict, device, sixteen: bool = False) -> str:
    """'' when check_stages fits beside the slices on this rank; else why not, with the estimate."""
    need, free = stages_need_bytes(slices, sixteen), free_bytes(device)
    if free is None or need <= free:
        return ""
    held = sum(p.numel() * p.element_size() for m in slices.values() for p in m.parameters())
    return (f"check_stages needs at least {_size(need)} on this rank beside its slices (which hold {_size(held)}: "
            f"two gradients of them and a float64 copy of one module, before activations) and it has "
            f"{_size(free)} {_where(device)}: spread the model over more ranks (fewer layers a stage), or check a "
            f"smaller configuration of the same code")


def watch_need_bytes(full: torch.nn.Module | None, own: list, every: int, state_per_param: int = 2,
                     slices: dict | None = None, sixteen: bool = False) -> tuple[int, int]:
    """The run watch's bytes on a rank (a lower bound, activations aside): (on the device: check_step's
    references and the watch's copy of the unsplit model `full`, or with `slices` (a model no rank holds
    whole) check_stages' beside the rank's slices, `stages_need_bytes`; on the host: for this rank's parameters
    `own`, the anchors' weights and optimizer state (`state_per_param` tensors a parameter: Adam's two
    moments): the checked step's, and with `every` > 1 the first step's after the last good check, and the
    gradients of every step since it, `every`, and of the step before)."""
    mine = sum(p.numel() * p.element_size() for p in own if p.is_floating_point())
    host = mine * ((1 + state_per_param) * (1 if every == 1 else 2) + every + 1)
    if slices is not None:
        return stages_need_bytes(slices, sixteen), host
    copy = sum(p.numel() * p.element_size() for p in full.parameters())
    return need_bytes(full) + copy, host


def disk_free_bytes(folder: str) -> int | None:
    """The free bytes of the disk that holds `folder`; None where it cannot be read."""
    import shutil

    try:
        return int(shutil.disk_usage(folder).free)
    except OSError:
        return None


def watch_too_large(full: torch.nn.Module | None, own: list, every: int, device, state_per_param: int = 2,
                    slices: dict | None = None, sixteen: bool = False, spill_dir: str | None = None) -> str:
    """'' when the run watch fits on this rank; else why not, with its estimate (the host's part counted
    against the host's memory, on the CPU both against the same; with `spill_dir`, the folder the snapshots are
    kept in off memory (labkit.check.spill), against that folder's disk instead)."""
    dev, host = watch_need_bytes(full, own, every, state_per_param, slices, sixteen)
    disk = host if spill_dir is not None else 0
    host -= disk
    refs = ("check_stages' references beside its slices" if slices is not None else
            "check_step's references and a copy of the unsplit model")
    on_gpu = torch.device(device).type == "cuda"
    free_dev, free_host = free_bytes(device), free_bytes("cpu")
    said = []
    if on_gpu and free_dev is not None and dev > free_dev:
        said.append(f"{_size(dev)} on its GPU ({refs}) and it has {_size(free_dev)} free")
    need_host = host if on_gpu else dev + host
    if free_host is not None and need_host > free_host:
        held = "" if not host else ("each checked step's weights and optimizer state and the gradients of the "
                                    f"{every} steps since it, kept on the host")
        what = ", and ".join(v for v in ("" if on_gpu else refs, held) if v)
        said.append(f"{_size(need_host)} of host memory ({what}) and it has {_size(free_host)} {_where('cpu')}")
    free_disk = disk_free_bytes(spill_dir) if disk else None
    if free_disk is not None and disk > free_disk:
        said.append(f"{_size(disk)} of disk in {spill_dir} (each checked step's weights and optimizer state and the "
                    f"gradients of the {every} steps since it, kept off memory) and it has {_size(free_disk)} free "
                    f"there (pass spill= a folder on a larger disk, or spill=False to hold them in memory)")
    if not said:
        return ""
    return (f"watch_run needs at least {' and '.join(said)}: watch a smaller configuration of the same code, "
            f"check fewer steps at once (every=1 keeps one step's gradients), or check single steps with "
            f"labkit.check_stages")
