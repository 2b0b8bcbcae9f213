"""labkit.notebook: deterministic views for tested notebooks."""

from labkit.notebook import pick_preset, tree


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
