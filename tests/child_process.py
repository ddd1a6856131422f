"""Runs a Python program in a process of its own, for tests that need a fresh one.

Some cases cannot share the test process: a failure that leaves DTensor's
device unusable, a race that aborts the process, state (the names DTensor
hands out) that only a new process starts from.
"""

import os
import subprocess
import sys


def run_python(source, *, devices=8, timeout=120, check=True, **env):
  """Runs `source` with `python -c` and `devices` logical CPU devices.

  Args:
    source: The program's text.
    devices: `TFSPMD_NUM_CPU_DEVICES` for it.
    timeout: Seconds it may take.
    check: Whether to assert that it exited with 0 (showing its stderr).
    **env: More environment variables for it.

  Returns:
    The `subprocess.CompletedProcess` (text `stdout` and `stderr`).
  """
  # One that dies of a signal prints every thread's Python stack.
  environ = dict(os.environ, TFSPMD_NUM_CPU_DEVICES=str(devices),
                 TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1", **env)
  run = subprocess.run([sys.executable, "-c", source], env=environ,
                       capture_output=True, text=True, timeout=timeout)
  if check:
    assert run.returncode == 0, run.stderr[-3000:]
  return run
