"""Runs the test file named by its first argument with pytest.

The `main` of every py_test in this package, so that each test file stays a
plain pytest file. pytest finds conftest.py and pyproject.toml in the runfiles
as it does in a checkout.
"""

import os
import sys

import pytest

if __name__ == "__main__":
  # Python put this file's resolved directory, in the source tree, first on
  # sys.path; only the runfiles may be importable. pytest adds their tests/.
  del sys.path[0]
  arguments = sys.argv[1:]
  # Where Bazel looks for the results of each test case.
  if "XML_OUTPUT_FILE" in os.environ:
    arguments.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
  sys.exit(pytest.main(arguments))
