"""What the run watch and check_stages need on a rank, estimated before they start (labkit.check.fits), on a
957M-parameter model built on the meta device (no memory): the estimates in bytes a parameter, and the sentence
a rank with too little memory gets."""

from __future__ import annotations

import torch
import torch.nn as nn

from labkit.check import fits


def _big(n_layers=57, dim=4096):
    with torch.device("meta"):  # 57 x (4096 x 4096 + 4096) = 957M parameters, no memory
        return nn.Sequential(*[nn.Linear(dim, dim) for _ in range(n_layers)])


def test_the_estimates_in_bytes_a_parameter():
    full = _big()
    n = sum(p.numel() for p in full.parameters())
    assert 950e6 < n < 960e6
    per_layer = 4096 * 4096 + 4096
    own = list(full[:28].parameters())  # a rank holding half of it
    dev, host = fits.watch_need_bytes(full, own, every=10)
    assert dev == n * (3 * 4 + 16) + n * 4  # check_step's references and the watch's copy of the model
    # two anchors (the checked step's, the first step's after the last good check): weights and Adam's two
    # moments each; 11 gradients
    assert host == 28 * per_layer * 4 * (2 * (1 + 2) + 10 + 1)
    assert fits.watch_need_bytes(full, own, every=1)[1] == 28 * per_layer * 4 * (1 + 2 + 1 + 1)
    slices = {0: full[:28]}
    assert fits.stages_need_bytes(slices) == 2 * 28 * per_layer * 4 + per_layer * 16
    assert fits.stages_need_bytes(slices, sixteen=True) == 2 * 28 * per_layer * 4 + per_layer * 8


def test_a_rank_without_room_gets_the_estimate(monkeypatch):
    monkeypatch.setattr(fits, "free_bytes", lambda device: 8 * 2 ** 30)  # 8 GiB available
    full = _big()
    said = fits.watch_too_large(full, list(full[:28].parameters()), 10, "cpu")
    assert said.startswith("watch_run needs at least ") and "GiB of host memory" in said, said
    assert "it has 8.00 GiB available" in said, said
    monkeypatch.setattr(fits, "free_bytes", lambda device: 2 * 2 ** 30)
    assert fits.stages_too_large({0: full[:28]}, "cpu").startswith("check_stages needs at least 3.75 GiB")
    monkeypatch.setattr(fits, "free_bytes", lambda device: None)  # unknown: nothing refused
    assert fits.watch_too_large(full, [], 1, "cpu") == "" and fits.stages_too_large({0: full}, "cpu") == ""


def test_with_slices_the_watch_holds_check_stages_need_not_the_whole_model(monkeypatch):
    """slices= (a model no rank holds whole): on the device check_stages' need beside the rank's slices instead of
    check_step's references and a copy of the whole model; on the host the same snapshots; refused with the
    estimate, saying so."""
    full = _big()
    per_layer = 4096 * 4096 + 4096
    own, slices = list(full[:28].parameters()), {0: full[:28]}
    dev, host = fits.watch_need_bytes(None, own, every=4, slices=slices)
    assert dev == fits.stages_need_bytes(slices) == 2 * 28 * per_layer * 4 + per_layer * 16
    assert host == 28 * per_layer * 4 * (2 * (1 + 2) + 4 + 1)
    assert fits.watch_need_bytes(None, own, 4, slices=slices, sixteen=True)[0] == fits.stages_need_bytes(slices, True)
    monkeypatch.setattr(fits, "free_bytes", lambda device: 8 * 2 ** 30)
    said = fits.watch_too_large(None, own, 4, "cpu", slices=slices)
    assert said.startswith("watch_run needs at least 23.01 GiB of host memory (check_stages' references beside "
                           "its slices, and each checked step's weights"), said
    monkeypatch.setattr(fits, "free_bytes", lambda device: 24 * 2 ** 30)
    assert fits.watch_too_large(None, own, 4, "cpu", slices=slices) == ""


def test_drift_noise_or_the_first_step_beyond_its_floor():
    from labkit.check.runs import RunReport, StepRecord

    r = RunReport(steps=[StepRecord(t, 2.0 - 0.01 * t, [1e-3], checked=True, ok=True, loss_floor=1e-6)
                         for t in range(60)])
    single = [2.0 - 0.01 * t + (1e-7 if t < 50 else 1e-4) for t in range(60)]  # apart from step 50
    d = r.drift(single)
    assert d.noise and d.first_step is None and d.beyond == 50 and d.floors == [1e-6] * 60
    assert d.text.startswith("noise: every step held within its floor (60 checked, every 1)"), d.text
    assert "part from the single-device run's at step 50" in d.text, d.text
    assert r.drift([2.0 - 0.01 * t for t in range(60)]).beyond is None
    r.first_wrong_step, r.stage, r.failure = 37, 1, "the update of stage 1's 'w' is not what AdamW.step gives"
    d = r.drift(single)
    assert not d.noise and d.first_step == 37 and d.text.startswith("step 37 is the first beyond its floor (stage 1)")
    assert "at the first step" in r.drift([3.0] * 60).text


def test_snapshots_kept_off_memory_are_counted_against_their_disk(monkeypatch, tmp_path):
    """With the snapshots spilled (labkit.check.spill: slices= by default), the host's memory holds check_stages'
    need alone and the snapshots are held against the free space of the folder that keeps them."""
    full = _big()
    own, slices = list(full[:28].parameters()), {0: full[:28]}
    dev, host = fits.watch_need_bytes(None, own, every=4, slices=slices)
    monkeypatch.setattr(fits, "free_bytes", lambda device: dev + 2 ** 20)  # check_stages fits, the snapshots would not
    assert fits.watch_too_large(None, own, 4, "cpu", slices=slices) != ""
    monkeypatch.setattr(fits, "disk_free_bytes", lambda folder: host + 2 ** 20)
    assert fits.watch_too_large(None, own, 4, "cpu", slices=slices, spill_dir=str(tmp_path)) == ""
    monkeypatch.setattr(fits, "disk_free_bytes", lambda folder: 2 ** 30)
    said = fits.watch_too_large(None, own, 4, "cpu", slices=slices, spill_dir=str(tmp_path))
    assert f"of disk in {tmp_path} (each checked step's weights" in said and "it has 1.00 GiB free there" in said, said
    assert "pass spill= a folder on a larger disk, or spill=False" in said and "of host memory" not in said, said
    monkeypatch.setattr(fits, "free_bytes", lambda device: dev - 1)  # check_stages alone does not fit: said alone
    said = fits.watch_too_large(None, own, 4, "cpu", slices=slices, spill_dir=str(tmp_path))
    assert "of host memory (check_stages' references beside its slices) and" in said, said
