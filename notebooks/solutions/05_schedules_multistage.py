"""Solutions to the exercises of notebook 05 (several stages per rank). Try them first!"""


def exercise_1():
    """pp_size p=4, 2 stages per rank, stage 5.

    loop: rank r holds r and r+p, so stage 5 = 1 + 4 is on rank 1.
    V: rank r holds r and 2p-1-r = 7-r, so stage 5 = 7 - 2 is on rank 2.
    """
    p, stage = 4, 5
    return stage % p, 2 * p - 1 - stage


def exercise_2():
    """ZBVZeroBubble, rank 0 of 4, 8 microbatches: rank 0 holds stages 0 and 7 (V placement).

    Each stage runs every microbatch forward once (F) and splits every backward into I and W:
    2 stages x 8 microbatches = 16 of each. No full backward B.
    """
    return {"F": 16, "I": 16, "W": 16}


def exercise_3():
    """With F=1, B=2 and 8 microbatches on 2 ranks x 2 stages, the split-backward schedules
    (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) all reach 1/49 of wall time, against 1/17
    for Interleaved1F1B and LoopedBFS: W fills what would be bubble. Any of the three is right.

        from labkit.theory import Cost, simulate
        {n: simulate(n, 2, 8, 2, Cost(F=1, B=2)).metrics()["bubble_fraction"] for n in MULTI}
    """
    return "ZBVZeroBubble"


def exercise_4():
    """ZBVZeroBubble on 2 ranks, 8 microbatches: rank 0 holds stages 0 and 3 (V placement: 0 and 2p-1-0).

    Each stage splits every microbatch's backward into I and W: 2 stages x 8 microbatches = 16 W.
    (Stage 0's I is empty in torch, but its W still runs, and is logged, once per microbatch.)
    """
    stages_on_rank0, microbatches = 2, 8
    return stages_on_rank0 * microbatches


def exercise_5(table, cap_bytes):
    """Half the cap: the fastest measured candidate that fits it and passed its check
    (`labkit.ranks.choose.choose`), defended with the table: its time and peak, and what every faster
    candidate would have cost in memory. With notebook 05's peaks, half of 200 KiB leaves the m = 32
    candidates of 1F1B and ZBVZeroBubble (80 KiB on their fullest rank); which of the two is faster is
    this run's measurement, and two within a few percent are both defensible.
    """
    from labkit import ChoiceTable

    half = ChoiceTable(table.rows, cap_bytes)
    best = half.choice
    faster = [r for r in half.rows if r.check_ok and r.step_s < best.step_s]
    cost = "; ".join(f"{r.schedule} m={r.n_microbatches} was faster ({1000 * r.step_s:.0f} ms) but holds "
                     f"{r.peak_bytes // 1024} KiB" for r in faster) or "nothing measured was faster"
    why = (f"{best.schedule} with m={best.n_microbatches}: {1000 * best.step_s:.0f} ms a step, checked against the "
           f"unsplit model, {best.peak_bytes // 1024} KiB on its fullest rank under the {cap_bytes // 1024} KiB cap; "
           f"{cost}.")
    return (best.schedule, best.n_microbatches), why
