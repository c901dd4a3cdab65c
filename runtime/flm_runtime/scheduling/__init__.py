"""Scheduling: the engine thread (``engine.py``), admission control, sequences, request handles and
the decoding step's interface (``step.py``). Plain decoding needs only this package and ``sampling``;
it never imports ``speculation``."""
