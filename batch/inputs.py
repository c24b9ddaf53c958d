"""Where a batch file's requests come from: one JSONL or Parquet file, or a directory of them, on this machine or at
any URI pyarrow's filesystems read (s3://, gs://, hdfs://: the ones Ray Data reads through), one record at a time.

A JSONL record is a line's text, parsed by its reader (a line that is not JSON is that line's error, not the file's);
a Parquet record is a row, its ``body`` a struct or a JSON string.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".parquet")


@dataclass(slots=True, frozen=True)
class Record:
    """One request of the input. ``number``: its place in the whole input (1, 2, ... across files, in name order),
    what the output file's resume keys the answers of id-less lines by; ``where``: what an error calls it ("line 3",
    or "part-1.jsonl line 3" in a directory, "row 3" of Parquet); ``value``: a line's text or a row's dict."""

    number: int
    where: str
    value: str | dict[str, Any]


def _filesystem(source: str):
    import pyarrow.fs as pafs

    if "://" in source:
        return pafs.FileSystem.from_uri(source)
    return pafs.LocalFileSystem(), str(Path(source).resolve())


def input_files(source: str) -> tuple[Any, str | None, list[str]]:
    """The filesystem, the directory ``source`` names (None for a file) and its files: itself, or the directory's
    .jsonl and .parquet files (recursively) in name order. ValueError naming ``source`` when it is missing or holds
    none."""
    import pyarrow.fs as pafs

    fs, path = _filesystem(source)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"input {source!r}: no such file or directory")
    if info.type != pafs.FileType.Directory:
        return fs, None, [path]
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = sorted(f.path for f in found if f.type == pafs.FileType.File and f.path.endswith(SUFFIXES))
    if not files:
        raise ValueError(f"input {source!r}: a directory holding no {' or '.join(SUFFIXES)} file")
    return fs, path, files


def records(source: str) -> Iterator[Record]:
    """Every request of ``source`` in order; blank lines are none."""
    fs, directory, files = input_files(source)
    number = 0
    for file in files:
        name = "" if directory is None else f"{file.removeprefix(directory).lstrip('/')} "
        for index, value in _file_records(fs, file):
            number += 1
            yield Record(number, f"{name}{'row' if isinstance(value, dict) else 'line'} {index}", value)


def _file_records(fs, file: str) -> Iterator[tuple[int, str | dict[str, Any]]]:
    if file.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open_input_file(file) as f:
            for index, row in enumerate(pq.read_table(f).to_pylist(), 1):
                yield index, _parquet_request(row)
        return
    with fs.open_input_stream(file) as raw, io.TextIOWrapper(raw, encoding="utf-8") as text:
        for index, line in enumerate(text, 1):
            if line.strip():
                yield index, line


def _parquet_request(row: dict[str, Any]) -> dict[str, Any]:
    """A row as the request a JSON line would be: a JSON-string body parsed (left as it is if it is not JSON: the
    reader refuses it by name), a struct body without the fields Parquet fills with nulls for other rows' keys."""
    body = row.get("body")
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except json.JSONDecodeError:
            pass
    elif isinstance(body, dict):
        body = _without_nulls(body)
    return row | {"body": body}


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
