"""The pure core: events, the fold and the command side. No I/O, no torch."""
