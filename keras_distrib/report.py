"""Plain-text output a person reads: one-line errors and aligned tables.

The demo, `keras-distrib test`, `keras-distrib env` and `kd.testing` report
in the same shape: a table with one row per run or check, and an error as
its type and first line, not a traceback (tracebacks of TensorFlow errors
run to dozens of lines and print whole tensors).
"""

import re
import textwrap

__all__ = [
    "error_line",
    "error_text",
    "table",
]

_CLASS = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
_OPENERS = {"(": ")", "[": "]", "{": "}"}
_RAISED = re.compile(r"^[A-Z]\w*(Error|Exception|Exit|Interrupt)(: |$)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Keras's first line around an error raised in a layer's call; the real one follows.
_KERAS_CALL = re.compile(r"^Exception encountered when calling .*\.$")


def _unbalanced(text):
    depth = 0
    for char in text:
        if char in _OPENERS:
            depth += 1
        elif char in _OPENERS.values():
            depth -= 1
    return depth > 0


def _message_lines(message):
    """The non-blank lines of an error message, what went wrong first.

    TensorFlow's "Graph execution error:" lists where each failing node was
    defined ("Detected at node ... defined at", then `File` lines) before
    the message itself; Keras wraps an error raised in a layer's `call` in
    "Exception encountered when calling ...", then the message, then the
    arguments. Both hide the message from anyone who reads the first line.
    """
    lines = [line.strip() for line in _ANSI.sub("", message).splitlines() if line.strip()]
    if lines and lines[0] == "Graph execution error:":
        kept = [line for line in lines[1:]
                if not line.startswith(("Detected at node", "File ", "[["))]
        lines = kept or lines
    if len(lines) > 1 and re.match(r"^\d+ root error\(s\) found\.$", lines[0]):
        lines = lines[1:] + [lines[0]]  # "(0) INVALID_ARGUMENT: ..." says what
    if len(lines) > 1 and _KERAS_CALL.match(lines[0]):
        lines = lines[1:] + [lines[0]]
    return lines


def error_line(error, width=None):
    """`Type: first line` of an exception (or of a `"Type: message"` string).

    The line that says what went wrong: TensorFlow's "Graph execution
    error:" and Keras's "Exception encountered when calling ..." give way
    to the message they wrap (`error_text` has all of it).

    A first line that opens a bracket it does not close (TensorFlow prints
    whole tensors inside its messages) is joined to the message's last line,
    with the middle elided; `<class 'a.b.C'>` is shortened to `C`. The
    result is whole (a reason is never cut), or cut to `width` characters
    when one is given (a fixed-width slot; `table(..., wrap=...)` wraps instead).

    Examples:
        >>> error_line(ValueError("Attempt to convert a value (PerReplica:{\\n"
        ...                       "  0: <tf.Tensor ...>\\n}) with an unsupported type "
        ...                       "(<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor."))
        'ValueError: Attempt to convert a value (PerReplica:{…}) with an unsupported type (PerReplica) to a Tensor.'
    """
    if isinstance(error, BaseException):
        kind, message = type(error).__name__, str(error)
    else:
        kind, _, message = str(error).partition(": ")
    lines = _message_lines(message)
    if lines and lines[0] == "in user code:":
        # tf.function's wrapper: the traceback, then the original `Type: message`.
        raised = [i for i, line in enumerate(lines) if _RAISED.match(line)]
        if raised:
            kind, _, first = lines[raised[-1]].partition(": ")
            lines = [first] + lines[raised[-1] + 1:]
    text = lines[0] if lines else ""
    if len(lines) > 1 and _unbalanced(text):
        text = f"{text}…{lines[-1]}"
    text = _CLASS.sub(r"\1", text)
    line = f"{kind}: {text}" if text else kind
    return line if width is None or len(line) <= width else line[: width - 1] + "…"


def error_text(error):
    """`Type: message` of an exception, whole, without TensorFlow's lists of frames.

    For a report with room for more than one line: TensorFlow's "Graph
    execution error:" keeps its message and node, not where each node was
    defined (the traceback says that); Keras's wrapper around a layer's
    error puts the message first.

    Examples:
        >>> print(error_text(ValueError("Exception encountered when calling Add.call().\\n\\n"
        ...                             "Incompatible shapes: [8,4] vs. [16,4]\\n\\n"
        ...                             "Arguments received by Add.call():\\n  t=(8, 4)")))
        ValueError: Incompatible shapes: [8,4] vs. [16,4]
          Arguments received by Add.call():
          t=(8, 4)
          Exception encountered when calling Add.call().
    """
    lines = _message_lines(str(error))
    head = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return "\n".join([head] + [f"  {line}" for line in lines[1:]])


def table(rows, headers, *, align=None, wrap=None):
    """Rows of cells as aligned text lines (a header line first).

    Args:
        rows: Sequences of cells (converted with `str`).
        headers: The column titles.
        align: Per column, `"<"` (left) or `">"` (right); numbers right by
            default when `None`: the first column left, the others right.
        wrap: Optional line width: a last column that would pass it is
            wrapped at spaces onto lines of its own column (never cut).

    Returns:
        A list of lines without trailing spaces.

    Examples:
        >>> print("\\n".join(table([("one", 1.5), ("three", 10)], ("name", "value"))))
        name   value
        one      1.5
        three     10
    """
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    columns = len(headers)
    align = align or ["<"] + [">"] * (columns - 1)
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(columns)]
    indent = sum(widths[:-1]) + 2 * (columns - 1)
    room = None if wrap is None else max(wrap - indent, 30)
    lines = []
    for row in cells:
        last = row[-1] if len(row) == columns else None
        pieces = [last] if last is None or room is None else textwrap.wrap(
            last, room, break_long_words=True, break_on_hyphens=False) or [""]
        if last is not None:
            row = row[:-1] + [pieces[0]]
        parts = [f"{cell:{align[i]}{widths[i]}}" for i, cell in enumerate(row)]
        lines.append("  ".join(parts).rstrip())
        lines += [" " * indent + piece for piece in pieces[1:]]
    return lines
