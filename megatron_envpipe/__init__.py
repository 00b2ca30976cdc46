"""megatron-envpipe: energy-saving pipeline-parallel training for Megatron-core.

The planning core (schedules, profiles, timeline, planners) is pure Python and
imports no torch; the Megatron and GPU edges are imported on demand.
"""

__version__ = "0.1.0"
