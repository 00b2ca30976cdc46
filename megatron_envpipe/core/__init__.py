"""Layer 1, pure Python (stdlib only): the data the rest of the package speaks.

Schedules (unit orders that print, parse and validate), Perseus-format
profiles, the pipeline DAG and its longest-path algorithms (``graph``), the
simulated timeline and plan scores, per-unit frequency plans, instruction
programs with their static deadlock check, the GPU clock table, the
vocabulary Enums, measured iteration timings and the executor hook interface.
"""
