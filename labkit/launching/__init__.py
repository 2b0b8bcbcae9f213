"""The parts of launching a torchrun job; `labkit.launch.launch()` puts them together.

rundir (Run record, run directories), command (torchrun argv and env), stream (live output),
processes (stopping, parent death), diagnose (which rank failed, where each rank was).
"""
