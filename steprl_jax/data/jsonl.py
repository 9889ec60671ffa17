"""Reading JSONL files with errors that name the file, the line and the field."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")


class DataFormatError(ValueError):
    """A malformed record: the message names the file, the line number and what is wrong."""


@dataclasses.dataclass
class LoadReport:
    """What a lenient load skipped (`skip_malformed=True`)."""

    path: str
    loaded: int = 0
    skipped: int = 0
    first_errors: list[str] = dataclasses.field(default_factory=list)


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) for each non-blank line; bad JSON raises `DataFormatError`."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except ValueError as err:
                raise DataFormatError(f"{path}:{number}: invalid JSON ({err})") from None


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
    """Parse every line with `parse(value, where)`, where `where` is "file:line".

    A malformed line raises `DataFormatError`, or with `skip_malformed` is counted in
    `report` (and in a warning-free way: the caller decides what to print).
    """
    report = report if report is not None else LoadReport(path=str(path))
    records: list[T] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                try:
                    value = json.loads(line)
                except ValueError as err:
                    raise DataFormatError(f"{where}: invalid JSON ({err})") from None
                records.append(parse(value, where))
            except DataFormatError as err:
                if not skip_malformed:
                    raise
                report.skipped += 1
                if len(report.first_errors) < 10:
                    report.first_errors.append(str(err))
    report.loaded = len(records)
    return records
