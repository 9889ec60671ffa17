"""Files on disk, at the bottom of the project (it imports only steprl_jax.errors): JSONL records
read with errors that name the file, the line and the field; lines appended whole or not at all;
and files (text, JSON, figures) replaced atomically, so that a reader sees the old file or the new
one, never half of one.

    from steprl_jax import io
    records = io.load_records(path, parse)         # parse(value, "file:line"); DataFormatError names the line
    io.append_whole(path, line_bytes)               # a failed write leaves no torn line
    io.write_json_atomic(path, data)                # NaN/inf refused, naming the key
    with io.atomic_output(path, suffix=".jsonl") as f: ...   # any writer, renamed into place at the end
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import math
import os
import tempfile
from typing import Any, Callable, Iterator, Optional, TypeVar

from steprl_jax.errors import BadInput

T = TypeVar("T")


# ------------------------------------------------------------------ JSONL records
class DataFormatError(BadInput):
    """A malformed record: the message names the file, the line number and what is wrong."""


@dataclasses.dataclass
class LoadReport:
    """What a lenient load skipped (`skip_malformed=True`)."""

    path: str
    loaded: int = 0
    skipped: int = 0
    first_errors: list[str] = dataclasses.field(default_factory=list)


def iter_text_lines(path: str | os.PathLike, error: type = DataFormatError) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of `path`, its newline kept. Each line is decoded on its
    own, so that bytes that are not UTF-8 are an `error` (default `DataFormatError`) naming the
    file and the line, not a bare UnicodeDecodeError."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            yield number, decode_line(raw, f"{path}:{number}", error)


def decode_line(raw: bytes, where: str, error: type = DataFormatError) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(
            f"{where}: not valid UTF-8 (byte {raw[err.start]:#04x} at byte {err.start + 1} of the line)") from None


def parse_line(text: str, where: str, error: type = DataFormatError) -> Any:
    try:
        return json.loads(text)
    except ValueError as err:
        raise error(f"{where}: invalid JSON ({err})") from None


def iter_json_lines(path: str | os.PathLike, error: type = DataFormatError) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) for each non-blank line; bad bytes or bad JSON raise `error`
    (default `DataFormatError`) naming the file and the line."""
    for number, line in iter_text_lines(path, error):
        if line.strip():
            yield number, parse_line(line, f"{path}:{number}", error)


def end_torn_line(path: str | os.PathLike) -> tuple[int, bytes] | None:
    """Before appending to a JSONL file: a last line without its newline that is a whole JSON
    object (only the newline was lost) gets the newline back; anything else is a write that never
    finished and is cut off. Returns (its line number, its bytes) when a line was removed."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        start = _last_line_start(f, f.seek(0, os.SEEK_END))
        f.seek(start)
        tail = f.read()
    if not tail:  # empty, or ends with a newline
        return None
    whole = _whole_json(tail)
    with open(path, "rb+") as f:
        if whole:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(start)
        os.fsync(f.fileno())
        number = _count_newlines(f, start) + 1
    return None if whole else (number, tail)


def _last_line_start(f, size: int) -> int:
    """Offset just after the last newline in the first `size` bytes of `f` (0 if there is none)."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        f.seek(start)
        at = f.read(end - start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


def _count_newlines(f, end: int) -> int:
    f.seek(0)
    count, left = 0, end
    while left > 0:
        chunk = f.read(min(left, 1 << 20))
        count, left = count + chunk.count(b"\n"), left - len(chunk)
    return count


def _whole_json(line: bytes) -> bool:
    """A JSON object ends with its closing brace: one that parses was written whole."""
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except ValueError:
        return False


def read_json(path: str | os.PathLike, how_to_go_on: str) -> Any:
    """The JSON value in the file `path` (a marker, a manifest). A damaged file (bad bytes, invalid
    JSON) is a `DataFormatError`: "{path}: not valid JSON ({error}); {how_to_go_on}"."""
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        return json.loads(raw.decode("utf-8"))
    except ValueError as err:  # UnicodeDecodeError is a ValueError too
        raise DataFormatError(f"{path}: not valid JSON ({err}); {how_to_go_on}") from None


def require(record: Any, field: str, kind: type | tuple[type, ...], where: str) -> Any:
    """`record[field]` if it exists with the right type, else a `DataFormatError` naming it."""
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if field not in record:
        raise DataFormatError(f"{where}: missing field '{field}'")
    value = record[field]
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataFormatError(f"{where}: field '{field}' must be {names}, got {type(value).__name__}")
    return value


def load_records(
    path: str | os.PathLike,
    parse: Callable[[Any, str], T],
    skip_malformed: bool = False,
    report: LoadReport | None = None,
) -> list[T]:
    """Parse every line with `parse(value, where)`, where `where` is "file:line" (a `.gz` file is
    read through gzip).

    A malformed line raises `DataFormatError`, or with `skip_malformed` is counted in
    `report` (and in a warning-free way: the caller decides what to print).
    """
    report = report if report is not None else LoadReport(path=str(path))
    records: list[T] = []
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                text = decode_line(raw, where)
                if text.strip():
                    records.append(parse(parse_line(text, where), where))
            except DataFormatError as err:
                if not skip_malformed:
                    raise
                report.skipped += 1
                if len(report.first_errors) < 10:
                    report.first_errors.append(str(err))
    report.loaded = len(records)
    return records


def append_bytes(fd: int, data: bytes, path: str) -> None:
    """Write all of `data` to `fd` (a file opened with O_APPEND by its only writer) and fsync it.

    A write may stop short (a full disk writes what fits, then fails): the rest is written or the
    call fails. On failure (no space, quota, I/O error) the file is cut back to the length it had
    before, so that no torn line is left for the next append to run into, and the OSError, with
    its errno, names `path`."""
    start = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError as err:
        try:
            os.ftruncate(fd, start)
            os.fsync(fd)
            left = "the file was cut back to its length before it (no partial line stays)"
        except OSError:
            left = "what it wrote could not be removed (a reader drops an incomplete last line)"
        raise OSError(err.errno, f"{err.strerror}: appending {len(data)} bytes failed and {left}; "
                                 f"free space and resume", path) from err


def append_whole(path: str | os.PathLike, data: bytes) -> None:
    """Append `data` (a line, a record) to `path`, creating it if needed, with `append_bytes`."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        append_bytes(fd, data, os.fspath(path))
    finally:
        os.close(fd)


# ------------------------------------------------------------------ files replaced atomically
@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "", mode: str = "w") -> Iterator[Any]:
    """A file object whose contents replace `path` when the block ends: written to a temporary
    file in the same folder (created if needed), flushed and fsynced, then renamed over `path`, so
    that a crash leaves the old file or the new one. An exception inside the block removes the
    temporary file and leaves `path` as it was. `mode` is "w" (UTF-8 text) or "wb"."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=suffix)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, suffix: str = "") -> None:
    """`text` written to `path` with `atomic_output`: a reader never sees half a file."""
    with atomic_output(path, suffix=suffix) as f:
        f.write(text)


def write_json_atomic(path: str | os.PathLike, data) -> None:
    """`data` as JSON, written atomically (`write_text_atomic`). Only valid JSON: a NaN or an
    infinity is a ValueError naming the file and where in `data` it is, and nothing is written."""
    try:
        text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False)
    except ValueError:
        where = non_finite_path(data)
        if where is None:
            raise
        raise ValueError(f"{path}: not written: {where[0]} is {where[1]}, which JSON cannot hold") from None
    write_text_atomic(path, text + "\n", suffix=".json")


def non_finite_path(data, path: str = "") -> Optional[tuple]:
    """(key path, value) of the first NaN or infinity in nested dicts and lists, e.g.
    ("last_iteration.loss", nan); None if there is none."""
    if isinstance(data, float) and not math.isfinite(data):
        return path or "the value", data
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, (list, tuple)) else ()
    for key, value in items:
        inner = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = non_finite_path(value, inner)
        if found is not None:
            return found
    return None


def save_figure_atomic(fig, path: str | os.PathLike) -> None:
    """A matplotlib figure as a PNG, written atomically; the figure is closed."""
    import matplotlib.pyplot as plt

    try:
        with atomic_output(path, suffix=".png", mode="wb") as f:
            fig.savefig(f, format="png", dpi=90)
    finally:
        plt.close(fig)
