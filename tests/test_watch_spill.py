"""The run watch's host snapshots kept off memory (labkit.check.spill): what is stored comes back bit for bit
(every dtype, a state's dict, a scalar, an empty tensor, a view), as a copy taken when it was stored, from an
unnamed file that is gone with its store; the in-memory store gives the same."""

from __future__ import annotations

import os

import pytest
import torch

from labkit.check.spill import SMALL_BYTES, HostCopies, Spilled, store


def _values():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 65, generator=g)
    return {
        "f32": big,
        "bf16": torch.randn(3000, generator=g).to(torch.bfloat16),
        "f64": torch.randn(700, generator=g, dtype=torch.float64),
        "i64": torch.randint(-5, 5, (900,), generator=g),
        "bool": torch.rand(5000, generator=g) > 0.5,
        "view": big.t()[3:40],  # not contiguous
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(3.0),
        "none": None,
        "state": {"step": torch.tensor(7.0), "exp_avg": torch.randn(2000, generator=g),
                  "exp_avg_sq": torch.rand(40, 50, generator=g), "note": "kept"},
    }


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and b.device.type == "cpu" and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("kind", ["spilled", "in memory"])
def test_what_is_stored_comes_back_bit_for_bit_as_a_copy_taken_then(kind):
    values = _values()
    held = store(True) if kind == "spilled" else store(False)
    assert isinstance(held, Spilled if kind == "spilled" else HostCopies)
    for n, v in values.items():
        held[n] = v
    kept = {n: (v.clone() if torch.is_tensor(v) else {k: x.clone() if torch.is_tensor(x) else x for k, x in v.items()}
                if isinstance(v, dict) else v) for n, v in values.items()}
    values["f32"].add_(1.0)  # written after it was stored: the store keeps what it was
    values["state"]["exp_avg"].zero_()
    assert sorted(held) == sorted(kept) and len(held) == len(kept) and "f32" in held and "nope" not in held
    for n in kept:
        assert _same(kept[n], held[n]), n
        assert _same(kept[n], held.get(n)), n
    assert held.get("nope") is None
    assert held.numel("view") == 37 * 64 and held.numel("empty") == 0
    if kind == "spilled":  # the large tensors in the file, read back as fresh tensors each time
        assert held.nbytes >= sum(v.numel() * v.element_size() for v in values.values()
                                  if torch.is_tensor(v) and v.numel() * v.element_size() > SMALL_BYTES)
        a, b = held["f32"], held["f32"]
        a.zero_()
        assert torch.equal(b, kept["f32"]) and torch.equal(held["f32"], kept["f32"])


def test_the_file_is_unnamed_and_gone_with_its_store(tmp_path):
    held = Spilled(str(tmp_path))
    held["w"] = torch.ones(10_000)
    fd = held._file.fileno()
    assert os.listdir(tmp_path) == []  # never a name in the folder: nothing to leave behind
    target = os.readlink(f"/proc/self/fd/{fd}")
    assert target.startswith(str(tmp_path)) and target.endswith("(deleted)"), target
    held.close()
    assert held._file.closed and len(held) == 0


def test_a_store_that_is_let_go_closes_its_file():
    held = Spilled()
    held["w"] = torch.ones(10_000)
    f = held._file
    del held
    assert f.closed
