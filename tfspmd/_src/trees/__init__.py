"""The trees layer: pytrees, on optree. Flattening, rebuilding, key paths and
custom nodes.
"""
