"""The folder the launcher puts first on the ranks' PYTHONPATH: its sitecustomize.py loads the span
recorder (labkit.spans.record) in every rank. A package only so that the wheel carries it."""
