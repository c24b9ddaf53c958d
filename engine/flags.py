"""Command-line flags and config files derived from the settings' one declaration (cluster/config.py).

A field ``max_num_seqs`` is the flag ``--max-num-seqs`` and the config-file key ``max-num-seqs`` (or
``max_num_seqs``), as vLLM spells them; a bool is ``--x`` / ``--no-x``; a Literal's values are the flag's choices;
its help is the field's description and default. A flag left out takes the field's default, so a default lives
in one place. Values are checked by the models themselves, and a bad one is reported as one line naming the flag
(or the key), the value and the rule.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], exclude: tuple[str, ...] = (), title: str | None = None
) -> list[str]:
    """Add a flag for each of `model`'s settings (nested models' fields are not settings) but those in `exclude`;
    returns the fields added."""
    group = parser.add_argument_group(title or f"{model.__name__} settings")
    added = []
    for name, info in model.model_fields.items():
        if name in exclude or _is_model(info.annotation):
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        names = [flag_name(name), *extra.get("flags", [])]
        kind, choices = _kind(info.annotation)
        help_text = (
            info.description if "default:" in info.description else f"{info.description} (default: {_shown(info)})"
        )
        help_text = help_text.replace("%", "%%")
        if kind is bool and name.startswith("no_"):  # a switch that is off unless named: no --no-no-... form
            group.add_argument(*names, dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
        elif kind is bool:
            group.add_argument(
                *names, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        else:
            many = typing.get_origin(kind) is list  # a list setting: the flag takes one or more values
            group.add_argument(
                *names,
                dest=name,
                type=typing.get_args(kind)[0] if many else kind,
                nargs="+" if many else None,
                choices=choices,
                default=argparse.SUPPRESS,
                metavar=None if choices else name.split("_")[-1].upper(),
                help=help_text,
            )
        added.append(name)
    return added


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _kind(annotation: Any) -> tuple[type, list | None]:
    """The argparse type and choices of a field's annotation (Optional unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), list(args)
    return annotation, None


def _shown(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "see above"
    return "none" if info.default is None else str(info.default)


def read_config_file(path: str, known: dict[str, str]) -> dict[str, Any]:
    """A YAML file of settings, keys as vLLM's `--config` reads them (the flag without its dashes, '-' or '_').
    `known` maps every accepted key spelling to its field; an unknown key is a ValueError naming it."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must be a mapping of settings to values, not a {type(data).__name__}")
    values = {}
    for key, value in data.items():
        field = known.get(str(key).lstrip("-").replace("-", "_"))
        if field is None:
            raise ValueError(f"--config {path}: unknown setting {key!r} (see raylm serve --help for the settings)")
        values[field] = value
    return values


def config_keys(*models: type[BaseModel]) -> dict[str, str]:
    """Every spelling a config file may use for each field of `models`, mapped to the field."""
    keys = {}
    for model in models:
        for name, info in model.model_fields.items():
            extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
            for spelling in [name, *(f.lstrip("-").replace("-", "_") for f in extra.get("flags", []))]:
                keys[spelling] = name
    return keys


def one_line(error: ValidationError, source: dict[str, str]) -> str:
    """The first of a ValidationError's problems as one line: the flag or config key, the value, the rule.
    `source` says where each field's value came from (a flag, or the config file)."""
    problem = error.errors()[0]
    field = str(problem["loc"][-1]) if problem["loc"] else ""
    rule = problem["msg"].removeprefix("Value error, ")
    if not field:
        return rule
    where = source.get(field, flag_name(field))
    return f"{where}={problem['input']!r} is invalid: {rule}"
