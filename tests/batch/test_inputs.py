"""batch/inputs.py: the requests of a JSONL file, a Parquet file, a directory of both, or a URI, in order, each
named where an error would name it; a Parquet body as a struct (its nulls dropped) or a JSON string."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch.inputs import records
from batch.openai_file import read_request

CHAT = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"}


def test_a_jsonl_files_lines_in_order_blank_ones_skipped(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": 2}\nnot json\n')
    got = [(r.number, r.where, r.value) for r in records(str(path))]
    assert got == [(1, "line 1", '{"a": 1}\n'), (2, "line 4", '{"b": 2}\n'), (3, "line 5", "not json\n")]


def test_a_directory_in_name_order_each_record_named_by_its_file(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps(CHAT | {"custom_id": "b1", "body": {"messages": []}}) + "\n")
    (tmp_path / "notes.txt").write_text("not an input")
    nested = tmp_path / "a"
    nested.mkdir()
    table = pa.Table.from_pylist(
        [
            CHAT | {"custom_id": "a1", "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}},
            CHAT | {"custom_id": "a2", "body": {"messages": [{"role": "user", "content": "Yo"}], "n": 2}},
        ]
    )
    pq.write_table(table, nested / "part.parquet")
    got = list(records(str(tmp_path)))
    assert [(r.number, r.where) for r in got] == [
        (1, "a/part.parquet row 1"),
        (2, "a/part.parquet row 2"),
        (3, "b.jsonl line 1"),
    ]
    # Parquet gave every row both structs' keys, null where a row had none: they are absent again
    assert [read_request(r.value) for r in got[:2]] == [
        ("a1", CHAT["url"], {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        ("a2", CHAT["url"], {"messages": [{"role": "user", "content": "Yo"}], "n": 2}),
    ]
    assert read_request(got[2].value)[0] == "b1"


def test_a_parquet_body_may_be_a_json_string_and_a_uri_is_read(tmp_path):
    body = {"prompt": "Once", "max_tokens": 3}
    pq.write_table(
        pa.Table.from_pylist([CHAT | {"url": "/v1/completions", "body": json.dumps(body)}]), tmp_path / "x.parquet"
    )
    (record,) = records(f"file://{tmp_path / 'x.parquet'}")
    assert record.where == "row 1" and read_request(record.value) == ("c", "/v1/completions", body)


def test_a_missing_input_or_a_directory_of_none_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        list(records(str(tmp_path / "absent.jsonl")))
    (tmp_path / "readme.md").write_text("")
    with pytest.raises(ValueError, match=r"holding no \.jsonl or \.parquet file"):
        list(records(str(tmp_path)))
