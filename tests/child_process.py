"""Runs a Python program in a process of its own, for tests that need a fresh one.

Some cases cannot share the test process: a failure that leaves DTensor's
device unusable, a race that aborts the process, state (the names DTensor
hands out) that only a new process starts from.
"""

import os
import subprocess
import sys


def run_python(source, *, devices=8, timeout=120, check=True, cwd=None,
               **env):
  """Runs `source` with `python -c` and `devices` logical CPU devices.

  Args:
    source: The program's text.
    devices: `TFSPMD_NUM_CPU_DEVICES` for it, or None to leave it as this
      process's environment (and `env`) has it.
    timeout: Seconds it may take.
    check: Whether to assert that it exited with 0 (showing its stderr).
    cwd: Its working directory (default: this process's).
    **env: More environment variables for it, over the defaults (TensorFlow
      logs errors only; a death by signal prints every thread's stack).

  Returns:
    The `subprocess.CompletedProcess` (text `stdout` and `stderr`).
  """
  environ = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONFAULTHANDLER="1")
  if devices is not None:
    environ["TFSPMD_NUM_CPU_DEVICES"] = str(devices)
  environ.update(env)
  run = subprocess.run([sys.executable, "-c", source], env=environ, cwd=cwd,
                       capture_output=True, text=True, timeout=timeout)
  if check:
    assert run.returncode == 0, run.stderr[-3000:]
  return run
