"""The runtime layer: devices, DTensor meshes and layouts, placing host data and
reading it back, the result array, and the axes bound while a program traces.
"""
