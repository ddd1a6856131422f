"""The wheel: what `pip install tfspmd` puts in an environment.

The wheel is built offline from a copy of the sources, with this
environment's setuptools (the `test` extra), and installed into a fresh
virtual environment that borrows TensorFlow, NumPy, absl and Keras from this
one, so nothing is downloaded.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile

import absl
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfspmd

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "tfspmd", "adapters")

# Run in the fresh environment, from a folder outside the repository.
_IMPORTS = """
import importlib.metadata, importlib.util, json
import tfspmd, tfspmd.adapters, tfspmd.adapters.keras_training
print(json.dumps({
    "tfspmd": tfspmd.__file__,
    "adapters": tfspmd.adapters.__file__,
    "keras_training": tfspmd.adapters.keras_training.__file__,
    "version": tfspmd.__version__,
    "metadata_version": importlib.metadata.version("tfspmd"),
}))
"""


def _run(command, **kwargs):
  result = subprocess.run(command, capture_output=True, text=True, check=False,
                          timeout=300, **kwargs)
  assert result.returncode == 0, (
      f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}")
  return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  """The path of the wheel built from a copy of the sources."""
  sources = tmp_path_factory.mktemp("sources")
  for name in _SOURCES:
    path = os.path.join(_ROOT, name)
    if os.path.isdir(path):
      shutil.copytree(path, sources / name,
                      ignore=shutil.ignore_patterns("__pycache__", "BUILD"))
    else:
      shutil.copy(path, sources / name)
  out = tmp_path_factory.mktemp("wheel")
  # Without build isolation, pip builds with this environment's setuptools
  # instead of downloading one.
  setuptools = importlib.metadata.version("setuptools")
  assert int(setuptools.split(".")[0]) >= 77, (
      f"building the wheel needs setuptools>=77 (the `test` extra), this "
      f"environment has {setuptools}: pip install -e '.[test]'")
  _run([sys.executable, "-m", "pip", "wheel", "--no-deps",
        "--no-build-isolation", "--no-index", "--quiet", "-w", str(out),
        str(sources)])
  (built,) = out.iterdir()
  return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
  """What the fresh environment's Python sees of the installed tfspmd."""
  venv = tmp_path_factory.mktemp("venv")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                 check=True)
  python = str(venv / "bin" / "python")
  # pip runs in the fresh environment but with its own folder on the path,
  # where a tfspmd may be installed already: install anyway.
  _run([sys.executable, "-m", "pip", "--python", python, "install",
        "--no-deps", "--no-index", "--ignore-installed", "--quiet",
        str(wheel)])
  site_packages = _run([python, "-c",
                        "import sysconfig; print(sysconfig.get_path('purelib'))"
                        ]).strip()
  # The dependencies come from this environment, after the fresh one's own
  # folder; a .pth line adds a folder without running that folder's .pth
  # files (so not this environment's editable tfspmd).
  borrowed = sorted({os.path.dirname(os.path.dirname(module.__file__))
                     for module in (tf, np, absl, keras)})
  with open(os.path.join(site_packages, "dependencies.pth"), "w",
            encoding="utf-8") as f:
    f.write("\n".join(borrowed) + "\n")
  outside = tmp_path_factory.mktemp("elsewhere")
  environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  seen = json.loads(_run([python, "-c", _IMPORTS], cwd=outside,
                         env=environ).splitlines()[-1])
  seen["site_packages"] = site_packages
  return seen


def _names(wheel):
  with zipfile.ZipFile(wheel) as archive:
    return archive.namelist()


def test_installed_package_imports_from_outside_the_repository(installed):
  package = os.path.join(installed["site_packages"], "tfspmd")
  assert installed["tfspmd"] == os.path.join(package, "__init__.py")
  assert installed["adapters"] == os.path.join(package, "adapters",
                                               "__init__.py")
  assert installed["keras_training"] == os.path.join(
      package, "adapters", "keras_training.py")


def test_no_top_level_adapters_package_is_installed(wheel, installed):
  assert not [n for n in _names(wheel) if n.split("/")[0] == "adapters"]
  assert "adapters" not in os.listdir(installed["site_packages"])
  with zipfile.ZipFile(wheel) as archive:
    (top_level,) = [n for n in archive.namelist()
                    if n.endswith(".dist-info/top_level.txt")]
    assert archive.read(top_level).decode().split() == ["tfspmd"]


def test_wheel_holds_every_module_of_the_checkout(wheel):
  expected = set()
  for folder, installed_as in (("tfspmd", "tfspmd"),
                               ("adapters", "tfspmd/adapters")):
    for parent, _, files in os.walk(os.path.join(_ROOT, folder)):
      relative = os.path.relpath(parent, os.path.join(_ROOT, folder))
      for name in files:
        if name.endswith(".py"):
          expected.add(os.path.normpath(
              os.path.join(installed_as, relative, name)))
  assert expected <= set(_names(wheel))


def test_wheel_holds_the_license_and_py_typed(wheel):
  names = _names(wheel)
  assert "tfspmd/py.typed" in names
  (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/"
                                                    "LICENSE")]
  with zipfile.ZipFile(wheel) as archive:
    text = archive.read(license_name).decode()
  assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_metadata_version_is_the_package_version(wheel, installed):
  assert os.path.basename(wheel).startswith(f"tfspmd-{tfspmd.__version__}-")
  assert installed["metadata_version"] == tfspmd.__version__
  assert installed["version"] == tfspmd.__version__


def test_metadata_declares_the_license_and_project_urls(wheel):
  with zipfile.ZipFile(wheel) as archive:
    (metadata,) = [n for n in archive.namelist()
                   if n.endswith(".dist-info/METADATA")]
    text = archive.read(metadata).decode()
  assert "License-Expression: Apache-2.0" in text
  for name in ("Homepage", "Source", "Documentation", "Changelog"):
    assert f"Project-URL: {name}, https://github.com/tfspmd/tfspmd" in text
  assert "OWNER" not in text
  # The Python versions TensorFlow 2.21 ships wheels for.
  for minor in (10, 11, 12, 13):
    assert f"Classifier: Programming Language :: Python :: 3.{minor}" in text
  assert "Requires-Python: >=3.10" in text
  assert "Summary: JAX's pmap programming model for TensorFlow" in text
