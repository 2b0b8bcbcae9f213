"""Choosing schedule and m under an activation cap (labkit.ranks.choose, notebook 05), and the activation
tracker it relies on counting per step (labkit.worker.memory.SavedTensorTracker, issue 42).

The choosing logic and its figure are tested without ranks; one test runs 3 schedules x 3 m on the
suite's warm pool of 4 ranks, checks every step against the unsplit model and reads time and peak."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

from conftest import module_pool
from labkit.core.errors import ConfigError
from labkit.ranks.choose import Candidate, ChoiceTable, choose, plot_choice, rank_peak
from labkit.worker.memory import SavedTensorTracker


def rows():
    return [Candidate("1F1B", 8, 0.30, 100_000, True), Candidate("1F1B", 16, 0.40, 60_000, True),
            Candidate("ZBVZeroBubble", 8, 0.20, 200_000, True), Candidate("ZBVZeroBubble", 16, 0.10, 50_000, False)]


def test_the_choice_is_the_fastest_that_fits_and_passed():
    t = ChoiceTable(rows(), cap_bytes=120_000)
    assert [r.fits for r in t.rows] == [True, True, False, True]
    assert (t.choice.schedule, t.choice.n_microbatches) == ("1F1B", 8)  # ZBV m=16 is faster but failed its check
    assert choose(t.rows, 50_000) is None  # only the failed one fits
    assert choose(t.rows, 10**9).schedule == "ZBVZeroBubble"
    text = t.text()
    assert "<- choice" in text.splitlines()[2] and "FAILED" in text and "cap 117 KiB" in text
    assert "no candidate fits" in ChoiceTable(rows(), cap_bytes=1000).text()


def test_bad_caps_and_measurements_are_refused_with_a_fix():
    for cap in (0, -5, 1.5, True):
        with pytest.raises(ConfigError, match="whole number of bytes"):
            ChoiceTable(rows(), cap_bytes=cap)
    with pytest.raises(ConfigError, match=">= 0"):
        Candidate("1F1B", 8, -1.0, 10, True)


def test_plot_choice_draws_every_candidate_the_cap_and_the_choice():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    t = ChoiceTable(rows(), cap_bytes=120_000)
    artists = plot_choice(ax, t)
    labels = [h.get_label() for h in ax.get_legend().legend_handles]
    assert "choice: 1F1B, m=8" in labels and "ZBVZeroBubble: check failed" in labels
    assert any(getattr(a, "get_xdata", None) and a.get_xdata()[0] == pytest.approx(120_000 / 1024) for a in artists)
    assert sum(1 for a in artists if isinstance(a, matplotlib.text.Annotation)) == len(t)
    plt.close(fig)


def test_rank_peak_sums_a_ranks_stages_at_each_moment():
    events = [(0, 0, 10, None), (1, 3, 5, None), (2, 0, 2, None), (3, 3, 20, None)]
    assert rank_peak(events) == 22  # not 10 + 20: the stages peaked at different times


class FakeStage:
    """What the tracker reads of a PipelineStage, with the call torch's step() makes first."""

    def __init__(self, module, index=0):
        self.submod, self.stage_index, self.cleared = module, index, 0

    def clear_runtime_states(self):
        self.cleared += 1


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def test_one_tracker_counts_each_step_from_zero_and_says_what_was_carried():
    mod, x = mlp(), torch.randn(3, 4)
    stage = FakeStage(mod)
    tracker = SavedTensorTracker([stage])
    stage.clear_runtime_states()  # what step() does first
    mod(x).sum().backward()
    first = tracker.peak()
    kept = mod(x)  # a forward whose graph outlives its step
    stage.clear_runtime_states()
    assert stage.cleared == 2 and tracker.steps == 2 and tracker.carried == first and tracker.events == []
    mod(x).sum().backward()
    assert tracker.peak() == first  # not first + what `kept` holds
    del kept
    assert tracker.events[-1][2] == 0  # the earlier step's holder left without touching this step's count


def test_a_second_tracker_replaces_the_first():
    mod, x = mlp(), torch.randn(3, 4)
    stage = FakeStage(mod)
    first = SavedTensorTracker([stage])
    second = SavedTensorTracker([stage])
    stage.clear_runtime_states()
    mod(x).sum().backward()
    assert second.peak()[0] > 0 and first.events == [] and stage.cleared == 1


def test_saved_outputs_are_released_when_a_retained_graph_goes():
    """A split backward's I runs with retain_graph=True and W does not walk the whole graph: what the
    graph saved must go when the graph goes. The holder once kept the saved tensor itself, and for a
    saved output (ReLU saves its result) that made a cycle through autograd's C++ node: never freed."""
    mod, x = mlp(), torch.randn(3, 4)
    tracker = SavedTensorTracker([FakeStage(mod)])
    out = mod(x)
    out.sum().backward(retain_graph=True)
    assert tracker.events[-1][2] > 0  # retained, as asked
    del out
    gc.collect()
    assert tracker.events[-1][2] == 0


SETUP = """
import torch, torch.nn as nn
import torch.distributed.pipelining as pipelining
from torch.distributed.pipelining import PipelineStage
from labkit.schedules.table import SCHEDULES, stage_placement
from labkit.models.workload import mse
from labkit.worker.memory import SavedTensorTracker

DIM, BATCH, BLOCKS = 32, 32, 8
g = torch.Generator().manual_seed(0)
xb, yb = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


class Part(nn.Module):  # consecutive blocks of the unsplit model, under the unsplit model's names
    def __init__(self, full, first, end):
        super().__init__()
        for i in range(first, end):
            self.add_module(str(i), full[i])

    def forward(self, h):
        for block in self.children():
            h = block(h)
        return h


def build(name, m):
    info = SCHEDULES[name]
    spr = 2 if info.multi else 1
    n = world_size * spr
    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM))
                           for _ in range(BLOCKS)])
    per = BLOCKS // n
    mine = stage_placement(world_size, spr, info.v_shaped)[rank]
    stages = [PipelineStage(Part(full, s * per, (s + 1) * per), s, n, device, input_args=torch.zeros(BATCH // m, DIM))
              for s in mine]
    schedule = getattr(pipelining, info.cls)(stages if info.multi else stages[0], n_microbatches=m, loss_fn=mse)
    return full, stages, schedule
"""

pool = module_pool(4, SETUP)


@pytest.mark.launches
def test_three_schedules_by_three_m_on_four_live_ranks(pool):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.ranks.choose import measure_choices

    names, ms = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"], [8, 16, 32]
    table = measure_choices(pool, "build", names, ms, cap_bytes=24 * 1024, batch=("xb", "yb"))
    assert [(r.schedule, r.n_microbatches) for r in table.rows] == [(n, m) for n in names for m in ms]
    assert all(r.check_ok for r in table.rows), table.text()
    assert all(r.step_s > 0 and r.peak_bytes > 0 and len(r.peak_per_rank) == 4 for r in table.rows)
    one = {r.n_microbatches: r.peak_per_rank[0] for r in table.rows if r.schedule == "1F1B"}
    assert one[8] > one[16] > one[32]  # 1F1B's rank 0 holds 4 microbatches of B/m samples
    assert table.choice is None or (table.choice.fits and table.choice.check_ok)
    fig, ax = plt.subplots()
    assert plot_choice(ax, table)
    plt.close(fig)
    # one tracker over two ZBVZeroBubble steps: the second counts from zero, as the first did
    peaks = pool.exec("""
full, stages, schedule = build("ZBVZeroBubble", 8)
tracker, peaks = SavedTensorTracker(stages), []
for _ in range(2):
    schedule.step(*((xb,) if stages[0].is_first or stages[1].is_first else ()),
                  **({"target": yb, "losses": []} if any(s.is_last for s in stages) else {}))
    peaks.append((tracker.peak(), tracker.carried))
peaks
""")
    zbv8 = next(r for r in table.rows if (r.schedule, r.n_microbatches) == ("ZBVZeroBubble", 8))
    for r, (a, b) in peaks.items():
        assert a == b and a[1] == {} and b[1] == {}, (r, peaks)
        assert sum(a[0].values()) >= zbv8.peak_per_rank[r]  # per-stage peaks add up to at least the rank's
