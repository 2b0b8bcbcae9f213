"""The steps of scripts/gpu_check.py, one module a step, each read by its entry point's `main()`:

- common: the parts, the check's record (gpu_check.json, report.md) and what every step shares;
- environment: versions, the device, and how the children find the kit from a plain checkout;
- suite: parts 1-3, the reference job's suite on one rank, watched against each part's deadline;
- spans: part 3's reading, the kit's spans beside the profiler's view of the same actions;
- live: parts 4-5 on one live pool, a pipelined step and the memory tracker.

Nothing here imports torch or labkit at import time: on CPU the script itself never imports torch.
"""
