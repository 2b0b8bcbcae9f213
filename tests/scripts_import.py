"""Import helpers for the torchrun scripts under scripts/ (they are not a package)."""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_and_build(argv, world_size):
    mod = load_script("train_pipeline")
    return mod.config_from_args(mod.parse_args(argv), world_size)
