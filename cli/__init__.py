"""The `raylm` command line: one file per command (generate, serve, bench, batch), each adding its parser and the
function that runs it; this file only gathers them and turns a bad setting into one line and exit status 2."""

from __future__ import annotations

import argparse

from pydantic import ValidationError

from cli import batch, bench, generate, serve
from engine.flags import one_line


class _Parser(argparse.ArgumentParser):
    """Never takes a flag for a prefix of another: a vLLM flag raylm lacks is refused, named, not half-matched."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="raylm", description="LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    generate.add_parser(sub)
    serve.add_parser(sub)
    bench.add_parser(sub)
    batch.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ValidationError as e:  # a setting out of bounds, found by its model
        parser.exit(2, f"raylm: error: {one_line(e, {})}\n")
    except (ValueError, FileNotFoundError) as e:  # bad flags, or a missing model: the user's to fix
        parser.exit(2, f"raylm: error: {e}\n")
