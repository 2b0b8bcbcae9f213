"""Reference answers for notebook 00's exercises (look only after trying)."""

from labkit.theory import closed_form_bubble, simulate


def bubble_p4_m8() -> float:
    """Exercise 1: GPipe, 4 ranks, 8 microbatches. (p-1)/(m+p-1) = 3/11."""
    simulated = simulate("GPipe", pp_size=4, n_microbatches=8).metrics()["bubble_fraction"]
    assert abs(simulated - closed_form_bubble(4, 8)) < 1e-9
    return simulated


def smallest_m_below_20_percent() -> int:
    """Exercise 2: 1/(m+1) < 0.2 means m > 4, so m = 5."""
    m = 1
    while closed_form_bubble(2, m) >= 0.2:
        m += 1
    return m


def rank1_log(run) -> str:
    """Exercise 3: torchrun's per-rank folder is logs/<id>/attempt_0/<rank>/; the pipelining logger writes to stderr."""
    return str(run.log_path(1, "stderr").relative_to(run.run_dir))
