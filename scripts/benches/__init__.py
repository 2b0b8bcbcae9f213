"""The benchmarks of scripts/bench.py, one module a concern, each called by its entry point (`run_all`, `main`):
common (the repository's place, the interleaved A/B timing helpers and `WARM_UP`, what every module shares);
launch (`labkit launch` against plain torchrun, and start-up CPU with the collector paused); warm (ranks
started warm: fresh jobs by start method, a live pool's start, and their RESULTS.md rows and section); capture
(PP log capture, span recording and the profiler, on the step they watch); fidelity (every instrument's
bubble on real models, measured against ideal bubble, parser throughput); live (live ranks against fresh
jobs, and the notebook suite); check_cost (check_step and check_stages beside the step they check, and their
section); tutorial (the kit's job against the tutorial's program as written, and the GPU run); paper (the
zero-bubble paper's bubble rates beside the kit's, and their table); report (RESULTS.md: `markdown`, its main
table's rows, and the hand-kept tail).

Nothing here imports torch or labkit at import time: `scripts/bench.py --help` stays instant.
"""
