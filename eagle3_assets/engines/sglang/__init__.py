"""The ``sglang`` engine: its server (``server.py``), its in-process capture (``capture.py``), the
acceptance its EAGLE-3 worker reports (``acceptance.py``), the CPU support its CPU mode needs at run
time (``cpu/``), and the roles it serves (``roles.py``)."""
