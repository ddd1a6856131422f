"""Debug mode: each device's program runs eagerly in its own Python thread."""
