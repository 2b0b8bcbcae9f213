"""torchrun entry points of the kit, run as `python -m labkit.jobs.<name>` (the launcher passes `-m`).

Each reads its config from the run directory's config.json ($LABKIT_RUN_DIR), writes result.json there.
"""
