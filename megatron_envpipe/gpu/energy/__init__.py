"""Energy: the counter poller (monitor), its errors, the stepped counter's ticks, per-iteration energy."""
