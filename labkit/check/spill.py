"""The run watch's host snapshots (a step's weights, its optimizer state, the gradients its optimizer saw), held
in memory or kept off it: written to an unnamed temporary file as they are taken and read back one tensor at a
time when a check reads them. With `slices=` (a model no rank holds whole) the watch keeps them off memory by
default, so that what it adds to a rank at a check is check_stages' own need and one tensor at a time
(docs/live-ranks.md, "Memory").

Both stores take what they are given as a copy, taken then (`store[name] = tensor, a state's dict or None`),
and give back the same values (`store[name]`, `.get`, `in`, iteration): a tensor with its dtype and shape on the
host, a state's dict with its non-tensor entries as they were. `numel(name)` without reading it back. An
unnamed file is gone with its store (closed, or collected) and with the process, however it ends: nothing is
left on disk.

May import: torch."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

import torch

SMALL_BYTES = 4096
"""Tensors up to this many bytes stay in memory (Adam's `step` count, a scalar): not worth a read."""


def _host(v):
    return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v


class HostCopies(dict):
    """Snapshots held in memory: each tensor copied to the host as it is stored (a state's tensors too)."""

    def __setitem__(self, name, value) -> None:
        super().__setitem__(name, {k: _host(v) for k, v in value.items()} if isinstance(value, dict) else _host(value))

    def numel(self, name) -> int:
        return self[name].numel()

    def close(self) -> None:
        self.clear()


class _Place:
    """Where one spilled tensor lies in the file."""

    __slots__ = ("offset", "nbytes", "dtype", "shape")

    def __init__(self, offset: int, nbytes: int, dtype: torch.dtype, shape: torch.Size):
        self.offset, self.nbytes, self.dtype, self.shape = offset, nbytes, dtype, shape


class Spilled(Mapping):
    """Snapshots kept off memory, in an unnamed temporary file in `folder` (None: the system's temporary
    folder); a tensor written straight from its own storage when it is on the host (no copy of it in memory),
    through one host copy of it when it is on a device."""

    def __init__(self, folder: str | None = None):
        self._file = tempfile.TemporaryFile(dir=folder)
        self._end = 0
        self._at: dict = {}

    # -- writing ----------------------------------------------------------------------------------------------
    def _put(self, v):
        if not torch.is_tensor(v) or v.numel() * v.element_size() <= SMALL_BYTES:
            return _host(v)
        t = v.detach()
        t = (t.to("cpu") if t.device.type != "cpu" else t).contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        self._file.seek(self._end)
        self._file.write(memoryview(raw))
        place = _Place(self._end, raw.nbytes, t.dtype, t.shape)
        self._end += raw.nbytes
        return place

    def __setitem__(self, name, value) -> None:
        if isinstance(value, dict):
            self._at[name] = ("state", {k: self._put(v) for k, v in value.items()})
        else:
            self._at[name] = ("value", self._put(value))

    # -- reading ----------------------------------------------------------------------------------------------
    def _get(self, v):
        if not isinstance(v, _Place):
            return v
        if v.nbytes == 0:
            return torch.empty(v.shape, dtype=v.dtype)
        buf = bytearray(v.nbytes)
        self._file.seek(v.offset)
        got = self._file.readinto(buf)
        if got != v.nbytes:
            raise OSError(f"the watch's snapshot file gave back {got} of {v.nbytes} bytes")
        return torch.frombuffer(buf, dtype=torch.uint8).view(v.dtype).reshape(v.shape)

    def __getitem__(self, name):
        kind, v = self._at[name]
        return {k: self._get(x) for k, x in v.items()} if kind == "state" else self._get(v)

    def __iter__(self):
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, name) -> bool:
        return name in self._at

    def numel(self, name) -> int:
        kind, v = self._at[name]
        if kind != "value":
            raise TypeError(f"{name!r} holds an optimizer state, not a tensor")
        return int(torch.Size(v.shape).numel()) if isinstance(v, _Place) else v.numel()

    @property
    def nbytes(self) -> int:
        """The bytes written to the file."""
        return self._end

    def close(self) -> None:
        self._at = {}
        if not self._file.closed:
            self._file.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001  (at interpreter exit)
            pass


def store(spill: bool | str | None):
    """A new snapshot store: kept off memory where `spill` is True (the system's temporary folder) or a
    folder's path, held in memory where it is False or None."""
    return Spilled(folder(spill)) if spill else HostCopies()


def taken(spill: bool | str | None, named) -> HostCopies | Spilled:
    """A new store (`store`) holding a copy of each (name, tensor or state's dict) of `named`, taken now."""
    out = store(spill)
    for name, value in named:
        out[name] = value
    return out


def problem(spill) -> str:
    """'' where `spill` is one watch_run takes (None, True, False, or an existing folder); else the fix-it."""
    if spill is None or isinstance(spill, bool) or (isinstance(spill, (str, os.PathLike)) and os.path.isdir(spill)):
        return ""
    return (f"spill must be True (the host snapshots kept off memory, in the system's temporary folder), False "
            f"(held in memory) or an existing folder to keep them in, got {spill!r}")


def resolved(spill, sliced: bool) -> bool | str:
    """What `spill` means for a watch: by default (None) off memory where memory is the point (slices=)."""
    return sliced if spill is None else (spill if isinstance(spill, bool) else os.fspath(spill))


def folder(spill: bool | str | None) -> str | None:
    """The folder a store keeps its file in (None: held in memory)."""
    return None if not spill else (tempfile.gettempdir() if spill is True else os.fspath(spill))
