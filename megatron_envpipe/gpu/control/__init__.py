"""Clock control: locking clocks (the clock worker), proving control at start-up, the clock guard and its state store, repair."""
