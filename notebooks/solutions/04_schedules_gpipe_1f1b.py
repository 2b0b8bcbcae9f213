"""Solutions to the exercises of notebook 04 (GPipe and 1F1B). Try them first!"""


def exercise_1():
    """1F1B, pp_size p=4, m=8 microbatches: the same bubble as GPipe.

    bubble_fraction = (p-1)/(m+p-1) = 3/11 (idle share of wall time)
    bubble_ratio    = (p-1)/m       = 3/8  (idle over the ideal compute)
    """
    p, m = 4, 8
    return (p - 1) / (m + p - 1), (p - 1) / m


def exercise_2():
    """Smallest m with (p-1)/(m+p-1) < 0.10 for p=4: 3/(m+3) < 1/10  <=>  m > 27, so m = 28.

    GPipe runs all 28 forwards before any backward: stage 0 holds 28 microbatches.
    1F1B warms up with pp_size - stage = 4 forwards on stage 0, then alternates: it holds 4.
    """
    p = 4
    m = next(m for m in range(1, 1000) if (p - 1) / (m + p - 1) < 0.10)
    return m, m, p


def exercise_3():
    """GPipe, p=4 ranks, m=8 microbatches, F=200 ms and B=400 ms per stage.

    Each rank has m x (F + B) = 8 x 600 ms of work. Filling and draining the pipeline adds
    (p - 1) x (F + B): the last rank waits p-1 forwards for its first input, rank 0 waits p-1
    backwards for its first gradient. Ideal makespan = (m + p - 1) x (F + B) = 11 x 0.6 s = 6.6 s.
    """
    p, m, f, b = 4, 8, 0.200, 0.400
    return (m + p - 1) * (f + b)
