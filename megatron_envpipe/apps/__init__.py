"""Layer 5, applications: the ``envpipe`` command (``cli/``), the demo, Gantt and
frontier pictures, and the tiny GPT training example with its shipped data."""
