"""The catalogue of bad inputs: each raises its specific error, as docs/errors.md shows.

The rows are in `error_catalogue` and the `error_cases_*` modules. docs/errors.md
lists every row with the message it raises today; `test_docs_list_every_case`
keeps the two equal. After changing a message or a row, rewrite the page with

  TFSPMD_WRITE_ERRORS_DOC=1 .venv/bin/python -m pytest -q tests/test_errors.py
"""

import os
import re
import tempfile

import pytest

import error_catalogue

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PATH = os.path.join(_ROOT, "docs", "errors.md")
CATALOGUE = error_catalogue.all_cases()

_raised = {}


def raised(entry):
  """The exception `entry` raises (run once per process), or None."""
  if entry.id not in _raised:
    try:
      entry.trigger()
      _raised[entry.id] = None
    except Exception as e:  # pylint: disable=broad-except
      _raised[entry.id] = e
  return _raised[entry.id]


def message(error):
  """The message as docs/errors.md shows it: no addresses, paths or lines.

  A checkpoint in a fresh temporary directory shows as one in /tmp/run, its
  files' unique names as `<32 hex digits>`.
  """
  text = str(error)
  # Paths first: a temporary directory's random name may hold "0x5".
  text = re.sub(re.escape(os.path.join(tempfile.gettempdir(), "tmp")) +
                r"[\w-]+", "/tmp/run", text)
  text = re.sub(r"0x[0-9a-f]+", "0x...", text)
  text = re.sub(r"\.tfspmd-[0-9a-f]{32}", ".tfspmd-<32 hex digits>", text)
  return re.sub(r"\S*(tests/\w+\.py):\d+", r"\1:LINE", text)


def test_catalogue_has_at_least_40_kinds_with_distinct_ids():
  assert len(CATALOGUE) >= 40
  assert len({entry.id for entry in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("entry", CATALOGUE, ids=lambda entry: entry.id)
def test_bad_input_raises_a_specific_error(entry):
  error = raised(entry)
  assert error is not None, f"{entry.what}: nothing was raised"
  assert type(error) is entry.error, (  # pylint: disable=unidiomatic-typecheck
      f"{entry.what}: raised {type(error).__name__}: {error}")
  assert re.search(entry.match, message(error), re.S), message(error)
  # Raised inside a traced function, TensorFlow would wrap it with its trace.
  assert "in user code" not in message(error), message(error)


def render_doc():
  """docs/errors.md, from the catalogue and the messages raised now."""
  lines = [
      "# Errors: what each mistake raises",
      "",
      "Every kind of bad input tfspmd knows raises one specific exception "
      "whose message names",
      "the argument (its pytree path, such as `args[0]['w']` or "
      "`kwargs['x']`), what was",
      "expected and what was given; a mistake the call can go on from gives "
      "a warning instead,",
      "marked as one. This page is written from the catalogue in",
      "`tests/error_catalogue.py`, with the message each case raises, and a "
      "test keeps it equal",
      "to what the code raises (rewrite it with",
      "`TFSPMD_WRITE_ERRORS_DOC=1 .venv/bin/python -m pytest -q "
      "tests/test_errors.py`).",
      "",
      f"{len(CATALOGUE)} kinds of bad input.",
  ]
  groups = {}
  for entry in CATALOGUE:
    groups.setdefault(entry.group, []).append(entry)
  for group, entries in groups.items():
    lines += ["", f"## {group}", "", "| what you did | raises | message |",
              "| --- | --- | --- |"]
    for entry in entries:
      error = raised(entry)
      text = message(error) if error is not None else "(nothing raised)"
      kind = f"`{entry.error.__name__}`"
      if issubclass(entry.error, Warning):
        kind += " (a warning: the call goes on)"
      lines.append(f"| {_cell(entry.what)} | {kind} | {_cell(text)} |")
  lines += ["", "## Elsewhere", "", "| what you did | where |", "| --- | --- |"]
  for group, what, where in error_catalogue.PLACEHOLDERS:
    lines.append(f"| {_cell(what)} ({group}) | {_cell(where)} |")
  return "\n".join(lines) + "\n"


def _cell(text):
  """`text` in a Markdown table cell: `<lambda>` is not a tag, `|` no column."""
  for raw, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"),
                       ("|", "\\|")):
    text = text.replace(raw, escaped)
  return text.replace("\n", "<br>")


def test_docs_list_every_case():
  expected = render_doc()
  if os.environ.get("TFSPMD_WRITE_ERRORS_DOC"):
    with open(DOC_PATH, "w", encoding="utf-8") as f:
      f.write(expected)
  with open(DOC_PATH, encoding="utf-8") as f:
    assert f.read() == expected, (
        "docs/errors.md differs from the catalogue; rewrite it with "
        "TFSPMD_WRITE_ERRORS_DOC=1 .venv/bin/python -m pytest -q "
        "tests/test_errors.py")
