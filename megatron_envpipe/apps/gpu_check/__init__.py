"""``envpipe gpu-check``: one command, under 8 minutes, that answers what only a GPU can (docs/gpu-probe.md).

``steps.py`` lists the eight steps, ``runner.py`` runs each in a child process (``child.py``) with a
hard limit and resets clocks after each, ``step_api.py`` is the contract between them, and each step
lives in its own ``*_step.py``. The runner imports neither torch nor CUDA; the steps do, in their child.
"""
