"""The rewrites layer: pfor converters. How each op of the per-device program
becomes the batched op that DTensor expands, prints and checks carried out of
the program to happen after it runs, and the routes of last resort for an op
neither can take (docs/ops.md).
"""
