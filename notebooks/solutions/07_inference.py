"""Solutions to the exercises of notebook 07 (forward-only pipelines). Try them first!"""


def exercise_1():
    """Forward only, GPipe: every rank forwards microbatches 0..m-1 of its own stage, in order.
    Rank r starts at time r (the fill) and ends after m more forwards: makespan m + p - 1."""
    p, m = 3, 4
    return {r: [("F", r, i) for i in range(m)] for r in range(p)}


def exercise_2():
    """Each stage forwards a microbatch in T/(p m); the pipeline needs m + p - 1 such slots, so the
    makespan is (m + p - 1) T / (p m) and the speedup p m / (m + p - 1) = 32/11 = 2.91 for p=4, m=8."""
    p, m = 4, 8
    return p * m / (m + p - 1)
