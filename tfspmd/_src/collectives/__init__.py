"""Named-axis collectives: one module per family, each with its transpose."""
