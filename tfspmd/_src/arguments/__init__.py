"""The arguments layer: what a call is given and returns. Checked and normalized
arguments, in_axes and out_axes, donated arguments, and moving arrays to and
from the devices.
"""
