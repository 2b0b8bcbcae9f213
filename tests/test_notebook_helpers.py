"""What the notebooks import: labkit.notebook.helpers (setup, deterministic views, solutions), labkit.schedules.orders
(orders of actions, torch's short form) and labkit.worker.memory (what a stage holds)."""

from labkit.notebook.helpers import pick_preset, tree


def test_tree_hides_torchrun_ids(tmp_path):
    run = tmp_path / "20261122-101500-GPipe-manual-p2-m4-abc123"
    (run / "logs" / "labkit-20261122-101500-GPipe_ab12cd34" / "attempt_0" / "0").mkdir(parents=True)
    (run / "result.json").write_text("{}")
    text = tree(run)
    assert "<id>/" in text and "attempt_0/" in text and "result.json" in text and "ab12cd34" not in text


def test_pick_preset_on_cpu():
    import torch

    if not torch.cuda.is_available():
        assert pick_preset(2) == "tiny" and pick_preset(1, cpu="small") == "small"


def test_rank_orders_and_peak_in_flight_of_gpipe_and_1f1b():
    from labkit.schedules.orders import peak_in_flight, rank_orders
    from labkit.theory import planned_actions, simulate

    tl = simulate("1F1B", 4, 8)
    assert rank_orders(tl) == planned_actions("1F1B", 4, 8)
    assert peak_in_flight(tl) == {0: 4, 1: 3, 2: 2, 3: 1}  # 1F1B: at most pp_size - stage
    assert peak_in_flight(planned_actions("GPipe", 4, 8)) == {s: 8 for s in range(4)}  # GPipe: all m
    # a split backward frees a microbatch at W, not at I
    assert peak_in_flight({0: [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)]}) == {0: 2}


def test_rank_peak_in_flight_sums_a_ranks_stages_at_each_moment():
    from labkit.schedules.orders import peak_in_flight, rank_peak_in_flight

    order = {0: [("F", 0, 0), ("F", 2, 0), ("B", 2, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]}
    assert rank_peak_in_flight(order) == {0: 2} and peak_in_flight(order) == {0: 2, 2: 1}
    assert rank_peak_in_flight({0: [("F", 0, 0), ("I", 0, 0), ("F", 0, 1), ("W", 0, 0), ("W", 0, 1)]}) == {0: 2}


def test_torch_liveness_agrees_with_the_kits_count_except_torchs_own_1f1b_plan():
    """torch 2.15's analyze_pipeline_activation_liveness, against the kit's count (notebook 04)."""
    import pytest

    from labkit import SCHEDULES, versions
    from labkit.worker.memory import torch_liveness
    from labkit.schedules.orders import ScheduleError, rank_peak_in_flight
    from labkit.theory import planned_actions

    if not versions.has("activation liveness"):
        with pytest.raises(ScheduleError, match="needs torch 2.15"):
            torch_liveness("GPipe", 2, 4)
        return
    for name, info in SCHEDULES.items():
        spr = 2 if info.multi else 1
        for p, m in ((2, 4), (4, 8)):
            if name == "1F1B":
                with pytest.raises(ValueError, match=f"Action {p - 1}F{m} has a microbatch outside"):
                    torch_liveness(name, p, m, spr)
                continue
            assert torch_liveness(name, p, m, spr) == rank_peak_in_flight(planned_actions(name, p, m, spr if info.multi else None)), name



def test_torch_liveness_of_an_explicit_order_agrees_with_the_kits_count():
    """A searched order (notebook 13), loaded by torch's runtime as its CSV, analysed by torch 2.15."""
    import pytest

    from labkit import versions
    from labkit.worker.memory import torch_liveness
    from labkit.schedules.orders import ScheduleError, rank_peak_in_flight
    from labkit.theory.paper import handcrafted
    from labkit.theory.search import search

    # K=6: an order of the search's own rule (at K=8 the search now returns its ZB-H2 seed, checked below)
    order = search(4, 8, "F=1,I=1,W=1", memory_limit=6).order
    if not versions.has("activation liveness"):
        with pytest.raises(ScheduleError, match="needs torch 2.15"):
            torch_liveness(order, 4, 8)
        return
    assert torch_liveness(order, 4, 8) == rank_peak_in_flight(order) == {r: 6 for r in range(4)}
    h2 = handcrafted("ZB-H2", 4, 8)
    assert torch_liveness(h2, 4, 8) == rank_peak_in_flight(h2) == {r: 7 for r in range(4)}
    with pytest.raises(ScheduleError, match="one stage per rank"):
        torch_liveness(order, 4, 8, stages_per_rank=2)

def test_saved_activation_bytes_counts_activations_not_weights():
    import torch

    from labkit.worker.memory import saved_activation_bytes

    lin = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    # Linear saves its input (4x16 floats) and its weight (a parameter, left out)
    assert saved_activation_bytes(lin, x) == 4 * 16 * 4
    with torch.no_grad():
        assert saved_activation_bytes(lin, x) == 0


def test_torch_short_forms_of_an_order():
    from labkit.schedules.orders import format_order, order_csv, torch_actions

    order = {1: [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)], 0: [("F", 0, 0), ("B", 0, 0)]}
    assert torch_actions(order) == {0: ["0F0", "0B0"], 1: ["1F0", "1I0", "1W0"]}
    assert format_order(order) == "rank 0: 0F0 0B0\nrank 1: 1F0 1I0 1W0"
    assert order_csv(order) == "0F0,0B0\n1F0,1I0,1W0\n"


def test_solution_loads_an_answer_from_a_solutions_file(tmp_path, monkeypatch):
    from labkit.notebook.helpers import solution

    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "99_demo.py").write_text("ANSWER = 42\n")
    monkeypatch.chdir(tmp_path)
    assert solution("99_demo", "ANSWER") == 42


def test_solution_looks_only_next_to_the_running_notebook(tmp_path, monkeypatch):
    """An installed kit never reads the repository's notebooks/solutions: only ./solutions counts."""
    import pytest

    from labkit.notebook.helpers import solution

    monkeypatch.chdir(tmp_path)  # the repository's notebooks/solutions/00_welcome.py exists, but not here
    with pytest.raises(FileNotFoundError, match="solutions/ folder next to the notebooks") as e:
        solution("00_welcome", "exercise_1")
    assert str(tmp_path / "solutions" / "00_welcome.py") in str(e.value)


def test_notebook_keeps_the_names_the_notebooks_import():
    """The notebooks import order and memory helpers from labkit.notebook.helpers; their owners are elsewhere."""
    import labkit.worker.memory
    import labkit.notebook.helpers
    import labkit.schedules.orders

    for name in ("format_order", "order_csv", "peak_in_flight", "rank_orders", "torch_actions"):
        assert getattr(labkit.notebook.helpers, name) is getattr(labkit.schedules.orders, name), name
    for name in ("param_groups", "saved_activation_bytes"):
        assert getattr(labkit.notebook.helpers, name) is getattr(labkit.worker.memory, name), name
    assert set(labkit.notebook.helpers.__all__) <= set(dir(labkit.notebook.helpers))


# --- stages, Pipes and failed runs (notebooks 01, 02 and 09) ------------------------------------


def test_param_groups_and_compress_names_of_the_tutorial_model():
    from labkit.config.run import RunConfig
    from labkit.models.tutorial import build_model
    from labkit.worker.memory import param_groups
    from labkit.notebook.helpers import compress_names
    from labkit.worker.stages import manual_stage_module

    full = build_model(RunConfig(preset="tiny"))
    groups = param_groups(full)
    assert list(groups)[:2] == ["tok_embeddings", "layers.0"] and list(groups)[-2:] == ["norm", "output"]
    assert sum(groups.values()) == sum(p.numel() for p in full.parameters())
    second = param_groups(manual_stage_module(full, 1, 2))
    assert compress_names(second) == ["layers.4-7", "norm", "output"]
    assert compress_names(["layer0", "layer1", "a.1", "a.2", "a.4", "b"]) == ["layer0", "layer1", "a.1-2", "a.4", "b"]


def test_pipe_summary_of_a_traced_network():
    import torch
    from torch.distributed.pipelining import SplitPoint, pipeline

    from labkit.notebook.helpers import pipe_summary

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    pipe = pipeline(net, mb_args=(torch.randn(2, 4),), split_spec={"2": SplitPoint.BEGINNING})
    assert pipe_summary(pipe).splitlines() == ["stage 0: 0  [20 parameter elements]",
                                               "stage 1: 2  [10 parameter elements]"]


STACKS = """=== rank 0 ===
Fatal Python error: Aborted

Current thread 0x00007fec97a19b80 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2753 in send
  File "/repo/notebooks/scripts_09/hang.py", line 38 in main
  File "/repo/notebooks/scripts_09/hang.py", line 46 in <module>

Extension modules: numpy._core._multiarray_umath (total: 1)

=== rank 1 ===
Fatal Python error: Aborted

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f80b0fc3b80 (most recent call first):
  File "/repo/notebooks/scripts_09/hang.py", line 26 in load_next_batch
  File "/repo/notebooks/scripts_09/hang.py", line 40 in main
"""


def test_stack_frames_and_rank_locations_hide_folders_and_other_threads():
    from labkit.notebook.helpers import rank_locations, stack_frames

    assert stack_frames(STACKS, "hang") == {0: ["hang.py:38 in main", "hang.py:46 in <module>"],
                                            1: ["hang.py:26 in load_next_batch", "hang.py:40 in main"]}
    assert stack_frames(STACKS)[0][0] == "distributed_c10d.py:2753 in send"
    error = ("The job did not finish within the 15 s deadline and was stopped. Where each rank was:\n"
             "  rank 0: /repo/notebooks/scripts_09/hang.py:38 in main (innermost: distributed_c10d.py:2753 in send)\n"
             "  rank 1: /repo/notebooks/scripts_09/hang.py:26 in load_next_batch\n")
    assert rank_locations(error) == {0: "hang.py:38 in main", 1: "hang.py:26 in load_next_batch"}


def test_orders_in_torch_short_form_are_read_too():
    import pytest

    from labkit.schedules.orders import order_csv, peak_in_flight, torch_actions

    order = {0: "0F0 0F1 0B0 0B1".split(), 1: ["1F0", ("B", 1, 0), "1f1", "1B1"]}
    assert torch_actions(order) == {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
    assert order_csv(order).splitlines()[0] == "0F0,0F1,0B0,0B1"
    assert peak_in_flight(order) == {0: 2, 1: 1}
    with pytest.raises(ValueError, match="short form"):
        torch_actions({0: ["F00"]})


def test_tree_hides_torchrun_ids_with_underscores(tmp_path):
    # torchrun's log folder is tempfile.mkdtemp(prefix=f"{rdzv_id}_"): its 8 random characters include "_"
    run = tmp_path / "20261122-031244-hang-e4e9ef"
    (run / "logs" / "labkit-20261122-031244-hang-e4e9ef_t9zm_nv9" / "attempt_0" / "0").mkdir(parents=True)
    assert "t9zm_nv9" not in tree(run) and "<id>/" in tree(run)


# --- torch's short form of an action: one reader (labkit.schedules.orders.parse_action, on the log parser's grammar)


def test_parse_action_reads_torchs_short_form_and_says_how_to_fix_the_rest():
    import pytest

    from labkit.logs import decode_action
    from labkit.schedules.orders import ScheduleError, parse_action

    assert parse_action("0F1") == ("F", 0, 1) and parse_action(" 12w3 ") == ("W", 12, 3)
    assert parse_action("3I0") == decode_action("3I0")[:3]  # the same grammar as torch's log lines
    with pytest.raises(ScheduleError, match="not a compute action.*SEND/RECV"):
        parse_action("0SEND_F1")
    for bad in ("F01", "0F", "0X1", ""):
        with pytest.raises(ScheduleError, match="Cannot read action.*short form"):
            parse_action(bad, "rank 0, position 2")


def _custom_schedule_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "notebooks" / "scripts" / "custom_schedule.py"
    spec = importlib.util.spec_from_file_location("custom_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_schedule_reads_its_csv_with_the_kits_rules(tmp_path):
    """notebooks/scripts/custom_schedule.py (a torchrun script) reads and checks the order as the notebook does."""
    import pytest

    from labkit.schedules.orders import order_csv

    read_order = _custom_schedule_script().read_order
    order = {0: ["0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]}
    csv = tmp_path / "order.csv"
    csv.write_text(order_csv(order))
    rows, stage_rank, m = read_order(csv, 2)
    assert (rows, stage_rank, m) == (order, {0: 0, 1: 1}, 2)
    with pytest.raises(ValueError, match="has 2 rows but the job has 3 ranks"):
        read_order(csv, 3)
    bad = {
        "0F0,0F1\n0F2,1F0\n": "stage 0 appears on rank 0 and rank 1",
        "0F0,0X1\n1F0\n": "Cannot read action '0X1' \\(rank 0, position 1\\)",
        "0F0,0SEND_F0\n1F0\n": "not a compute action",
        "0F0\n2F0\n": "stages \\[1\\] appear in no row",
        "0F0,0F1,0B0\n1F0,1F1,1B0,1B1\n": "the backward of stage 0 mb 1 is missing",
        "\n\n": "lists no actions",
    }
    for text, match in bad.items():
        csv.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_order(csv, 2)


def test_saved_tensor_tracker_counts_each_microbatch_until_its_backward():
    import torch

    from labkit.core.actions import union_length
    from labkit.worker.memory import SavedTensorTracker, byte_range
    from labkit.models.workload import TimedBlock

    class Stage:  # what the tracker reads of a PipelineStage
        def __init__(self, module, index):
            self.submod, self.stage_index = module, index

    block = TimedBlock(16, 0.0, 0.0, 0.0, "sleep")
    tracker = SavedTensorTracker([Stage(block, 0)])
    batch = torch.randn(8, 16)
    outs = [block(chunk) for chunk in batch.chunk(4)]          # views of one batch: 2 x 16 floats each
    assert tracker.peak() == {0: 4 * 2 * 16 * 4}               # each view counts its own bytes, not the batch's
    outs[0].sum().backward()
    assert tracker.events[-1][2] == 3 * 2 * 16 * 4             # freed by its backward
    for o in outs[1:]:
        o.sum().backward()
    assert tracker.events[-1][2] == 0 and all(e[3] is None for e in tracker.events)  # CPU: no allocator reading
    t = torch.randn(4, 6)
    s, a, b = byte_range(t)
    s2, a2, b2 = byte_range(t.T)
    assert s == s2 and union_length([(a, b), (a2, b2)]) == 4 * 6 * 4  # a transpose is the same memory
    assert union_length([(0, 8), (4, 12), (20, 24)]) == 16
