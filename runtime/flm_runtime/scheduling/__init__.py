"""Scheduling: the engine thread (``engine.py``), the scheduler that plans its steps
(``scheduler.py``), admission control, sequences, request handles and the decoding step's interface
(``step.py``). Plain decoding needs only this package and ``sampling``; it never imports
``speculation``."""
