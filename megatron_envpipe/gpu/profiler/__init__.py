"""The start-up profiler: the clock sweep, attribution of energy to units, its corrections and the profile cache."""
