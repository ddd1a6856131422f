"""The README's quickstart runs as written on a machine with only a CPU."""

import os
import re
import subprocess
import sys

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What the quickstart's prints show, computed here: x ** 2; x / sum(x) of
# 0..3; row 3 of x / sum(x) of 0..7 in a 4 x 2 mesh.
_EXPECTED = [np.arange(8) ** 2, np.arange(4.) / 6, np.array([6., 7.]) / 28]


def _quickstart():
  with open(os.path.join(_ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  section = readme.split("## Quickstart", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def _numbers(text):
  return np.array([float(n) for n in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?",
                                                text)])


def test_quickstart_runs_on_a_cpu_only_machine_and_prints_what_it_shows(
    tmp_path):
  code = _quickstart()
  shown = [line.split("#", 1)[1] for line in code.splitlines()
           if line.startswith("print(")]
  environ = {k: v for k, v in os.environ.items()
             if k not in ("TFSPMD_NUM_CPU_DEVICES", "PYTHONPATH")}
  environ.update(PYTHONPATH=_ROOT, CUDA_VISIBLE_DEVICES="",
                 TF_CPP_MIN_LOG_LEVEL="2")
  result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                          env=environ, capture_output=True, text=True,
                          check=False, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  printed = result.stdout.splitlines()
  assert len(printed) == len(shown) == len(_EXPECTED), result.stdout
  for line, comment, expected in zip(printed, shown, _EXPECTED):
    np.testing.assert_allclose(_numbers(line), expected, rtol=1e-6)
    np.testing.assert_allclose(_numbers(comment), expected, rtol=1e-6)
