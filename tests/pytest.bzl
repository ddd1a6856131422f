"""pytest_test: one pytest file as a py_test, on one of tfspmd's executors."""

def pytest_test(name, src, deps = [], data = [], timeout = "moderate"):
    """A py_test running the test file `src` with pytest.

    Args:
      name: The target's name.
      src: The test file.
      deps: What it imports beyond the standard library.
      data: Files it reads.
      timeout: Bazel's timeout class.
    """
    pytest_group(name, [src], deps, data, timeout)

def pytest_group(name, srcs, deps = [], data = [], timeout = "moderate",
                 executor = None):
    """One py_test running several pytest files in one process.

    TensorFlow's import and pytest's start are paid once for the group.

    Args:
      name: The target's name.
      srcs: The test files.
      deps: What they import beyond the standard library.
      data: Files they read.
      timeout: Bazel's timeout class.
      executor: None for the default executor ('auto'), or the
        `tfspmd_executor` their programs run on ('dtensor').
    """
    native.py_test(
        name = name,
        timeout = timeout,
        srcs = srcs + ["pytest_main.py"],
        main = "pytest_main.py",
        args = ["$(rootpath %s)" % src for src in srcs] + (
            ["--executor=" + executor] if executor else []
        ),
        data = ["//:pytest_config"] + data,
        deps = deps,
    )
