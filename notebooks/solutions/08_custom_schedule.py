"""Solutions to the exercises of notebook 08 (your own schedule). Try them first!"""


def exercise_1():
    """Rank 0 runs F0 B0 F1 B1: it needs rank 1's backward of microbatch 0 before it sends the
    forward of microbatch 1. So rank 1 must run B0 before it asks for F1: F0 B0 F1 B1 (1F1B)."""
    return {0: "0F0 0B0 0F1 0B1".split(), 1: "1F0 1B0 1F1 1B1".split()}


def exercise_2():
    """1F1B, p=3 ranks, m=6: stage s warms up with min(m, p - s) forwards, then alternates
    B, F until every forward is done, then runs the remaining backwards."""
    p, m = 3, 6
    order = {}
    for s in range(p):
        acts, f, b = [], 0, 0
        for _ in range(min(m, p - s)):
            acts.append(f"{s}F{f}")
            f += 1
        while f < m:
            acts.append(f"{s}B{b}")
            b += 1
            acts.append(f"{s}F{f}")
            f += 1
        while b < m:
            acts.append(f"{s}B{b}")
            b += 1
        order[s] = acts
    return order
