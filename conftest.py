"""Shared test set-up: 8 logical CPU devices, made once per process.

TensorFlow can split the CPU into logical devices only before it creates
its devices, so this runs before any test module imports TensorFlow.
"""

import os
import sys

os.environ.setdefault("TFSPMD_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
