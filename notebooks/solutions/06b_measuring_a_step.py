"""Solutions to the exercise of notebook 06b (measuring a step). Try it first!"""


def longest_wait(report):
    """A spans report lists every gap of every rank with its seconds per cause (`report.gap_list`);
    the gap with the most "waiting for a neighbour" ends with the action that waited for its input:
    on rank 0 a backward (waiting for rank 1's gradient), on rank 1 a forward (rank 0's activation)."""
    rank, gap = max(((r, g) for r, gaps in report.gap_list.items() for g in gaps),
                    key=lambda rg: rg[1]["waiting for a neighbour"])
    return rank, gap["before"]
