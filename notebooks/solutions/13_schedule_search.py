"""Solutions to the exercises of notebook 13 (searching a schedule). Try them first!"""


def exercise_1():
    """Raise the limit one microbatch at a time until the span per rank reaches M(F+I+W) = 24: the
    search gets there at K = 7 = 2P - 1, the peak of the paper's ZB-H2 (K = 8 is not needed)."""
    from labkit.theory import search

    return next(k for k in range(4, 9) if search(4, 8, "F=1,I=1,W=1", memory_limit=k).period <= 24)


def exercise_2():
    """ZB-H1, p=3, m=6: stage s warms up with p - s forwards, then repeats I(j), W(j - s) when j >= s,
    the next F while any are left; then the W still owed."""
    p, m = 3, 6
    order = {}
    for s in range(p):
        acts = [f"{s}F{j}" for j in range(min(m, p - s))]
        next_f, next_w = len(acts), 0
        for j in range(m):
            acts.append(f"{s}I{j}")
            if j >= s:
                acts.append(f"{s}W{next_w}")
                next_w += 1
            if next_f < m:
                acts.append(f"{s}F{next_f}")
                next_f += 1
        acts += [f"{s}W{k}" for k in range(next_w, m)]
        order[s] = acts
    return order
