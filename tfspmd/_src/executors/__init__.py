"""What runs a traced program, and the defects of DTensor 2.21 it answers."""
