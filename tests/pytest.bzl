"""pytest_test: one pytest file as a py_test."""

def pytest_test(name, src, deps = [], data = [], timeout = "moderate"):
    native.py_test(
        name = name,
        timeout = timeout,
        srcs = [
            src,
            "pytest_main.py",
        ],
        main = "pytest_main.py",
        args = ["$(rootpath %s)" % src],
        data = ["//:pytest_config"] + data,
        deps = deps,
    )
