"""The folder the launcher puts first on the ranks' PYTHONPATH: its sitecustomize.py loads the span
recorder (labkit.spans.record) in every rank, and pauses the cyclic collector during torch's imports
in every process the launcher starts (labkit.core.startup). A package only so that the wheel carries it."""
