"""`tfspmd.adapters` in a source checkout, where it is the top-level adapters/.

An installed tfspmd holds its adapters as the subpackage `tfspmd/adapters/`.
A source checkout keeps them in `adapters/` beside `tfspmd/` (the same in
Bazel's runfiles), so there `import tfspmd.adapters` needs to be told where
they are. A finder that knows that one name does it: nothing else of the
checkout becomes importable under `tfspmd`, and the folder is never
importable as a top-level `adapters`, the import name of another package.
"""

import importlib.abc
import importlib.util
import os
import sys

NAME = "tfspmd.adapters"


class _Finder(importlib.abc.MetaPathFinder):
  """Finds `tfspmd.adapters` in the checkout's `adapters/` folder."""

  def __init__(self, folder):
    self.folder = folder

  def find_spec(self, fullname, path=None, target=None):
    del path, target  # unused: the one name has one place
    if fullname != NAME:
      return None
    return importlib.util.spec_from_file_location(
        NAME, os.path.join(self.folder, "__init__.py"),
        submodule_search_locations=[self.folder])


def install(package_folder):
  """Lets `import tfspmd.adapters` find a checkout's `adapters/`.

  Does nothing where the adapters are installed inside the package, or
  where the checkout has none (a Bazel target without `//adapters`).

  Args:
    package_folder: The folder of the `tfspmd` package being imported.
  """
  if os.path.isdir(os.path.join(package_folder, "adapters")):
    return
  folder = os.path.join(os.path.dirname(package_folder), "adapters")
  if not os.path.isfile(os.path.join(folder, "__init__.py")):
    return
  # First: the adapters beside this tfspmd, not those another install of
  # the project (an editable one of another checkout) maps the name to.
  if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder(folder))
