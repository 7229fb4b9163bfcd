"""Command-line flags that also read environment variables, as pods are configured, built from the
settings dataclasses themselves: every command of the project (server, client, precompute) uses it."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

# The key of a dataclass field's metadata under which its Flag or Section lives.
METADATA_KEY = "flag"


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose options default to $<env_prefix><OPTION> when that is set."""

    def __init__(self, *args, env_prefix: str, **kwargs):
        self.env_prefix = env_prefix
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        long_name = next((n for n in names if n.startswith("--")), None)
        if long_name and kwargs.get("action") not in ("help", "version"):
            env = self.env_prefix + long_name[2:].upper().replace("-", "_")
            if env in os.environ:
                raw = os.environ[env]
                kwargs["required"] = False  # the environment gave it
                kwargs["default"] = (raw.lower() in ("1", "true", "yes")) if kwargs.get("action") == "store_true" else raw
            kwargs["help"] = f"{kwargs.get('help', '')} [env {env}; default: %(default)s]"
        return super().add_argument(*names, **kwargs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flag:
    """How a settings field shows on the command line. Its default is the field's own.

    By default the flag is `--<field-name>`, typed after the field's default (int, float, text);
    a bool field defaulting to False is a switch, one defaulting to True is the switch `--no-<name>`.
    """

    help: str
    name: str | None = None  # the option, when not --<field-name>
    type: Callable[[str], Any] | None = None  # parses the option's text
    choices: Sequence[str] | None = None
    shown: Callable[[Any], str] | None = None  # the field's default -> the option's default text


@dataclasses.dataclass(frozen=True, kw_only=True)
class Section:
    """A field holding nested settings whose own flagged fields become flags, named with `prefix`.

    A section whose field defaults to None is built only when `switch` (a flag) is given or, without
    a switch, when any of its flags is given.
    """

    settings: type | None = None  # the nested dataclass; default: the field's default_factory
    prefix: str = ""
    switch: Flag | None = None


def flag(help: str, **options: Any) -> dict[str, Flag]:
    """A field's metadata that makes it a flag: `field(default=..., metadata=flag("what it is"))`."""
    return {METADATA_KEY: Flag(help=help, **options)}


def section(**options: Any) -> dict[str, Section]:
    """A field's metadata that makes the settings it holds flags too."""
    return {METADATA_KEY: Section(**options)}


@dataclasses.dataclass(frozen=True)
class _Option:
    field: dataclasses.Field
    spec: Flag
    name: str
    switch: bool = False  # the on-switch of an optional section
    negated: bool = False  # a bool setting defaulting to True: the flag turns it off

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


def add_config_flags(
    parser: argparse.ArgumentParser,
    settings: type,
    *,
    prefix: str = "",
    optional: bool = False,
    defaults: Any = None,
) -> None:
    """Adds a flag for every flagged field of the dataclass `settings` (and of its sections), in
    field order. Fields without a default are required, unless their section is optional.

    A section's flags default to the values of the instance its field's default_factory makes, so one
    settings class can serve two commands with different defaults; `defaults` is that instance.
    """
    for f in dataclasses.fields(settings):
        spec = f.metadata.get(METADATA_KEY)
        if isinstance(spec, Section):
            if spec.switch is not None:
                _add_option(parser, _switch(f, spec.switch, prefix), False, None)
            made = None if f.default_factory is dataclasses.MISSING else f.default_factory()
            add_config_flags(
                parser, _section_type(f, spec), prefix=prefix + spec.prefix, optional=f.default is None,
                defaults=made,
            )
        elif isinstance(spec, Flag):
            default = _default(f) if defaults is None else getattr(defaults, f.name)
            _add_option(parser, _option(f, spec, prefix), optional, default)


def config_from_args(settings: type, args: argparse.Namespace, *, prefix: str = "", **given: Any) -> Any:
    """The `settings` dataclass built from parsed flags; `given` fields are taken as they are."""
    values = {}
    for f in dataclasses.fields(settings):
        spec = f.metadata.get(METADATA_KEY)
        if f.name in given or spec is None:
            continue
        if isinstance(spec, Section):
            nested_prefix = prefix + spec.prefix
            if f.default is None and not _section_given(f, spec, args, prefix):
                values[f.name] = None
            else:
                values[f.name] = config_from_args(_section_type(f, spec), args, prefix=nested_prefix)
        else:
            option = _option(f, spec, prefix)
            value = getattr(args, option.dest)
            values[f.name] = not value if option.negated else value
    return settings(**values, **given)


def _section_given(f: dataclasses.Field, spec: Section, args: argparse.Namespace, prefix: str) -> bool:
    if spec.switch is not None:
        return bool(getattr(args, _switch(f, spec.switch, prefix).dest))
    nested = prefix + spec.prefix
    return any(
        getattr(args, _option(g, g.metadata[METADATA_KEY], nested).dest) is not None
        for g in dataclasses.fields(_section_type(f, spec))
        if isinstance(g.metadata.get(METADATA_KEY), Flag)
    )


def _section_type(f: dataclasses.Field, spec: Section) -> type:
    if spec.settings is not None:
        return spec.settings
    if f.default_factory is dataclasses.MISSING:
        raise TypeError(f"section {f.name}: give its dataclass as default_factory or as settings")
    return f.default_factory


def _flag_name(prefix: str, field_name: str) -> str:
    return "--" + prefix + field_name.replace("_", "-")


def _switch(f: dataclasses.Field, spec: Flag, prefix: str) -> _Option:
    return _Option(f, spec, spec.name or _flag_name(prefix, f.name), switch=True)


def _option(f: dataclasses.Field, spec: Flag, prefix: str) -> _Option:
    negated = f.default is True
    name = spec.name or ("--no-" + prefix + f.name.replace("_", "-") if negated else _flag_name(prefix, f.name))
    return _Option(f, spec, name, negated=negated)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _add_option(parser: argparse.ArgumentParser, option: _Option, optional: bool, default: Any) -> None:
    spec = option.spec
    kwargs: dict[str, Any] = {"dest": option.dest, "help": spec.help}
    if option.switch or isinstance(default, bool):
        kwargs.update(action="store_true", default=False)
    elif default is dataclasses.MISSING:
        kwargs.update(required=not optional, default=None, type=spec.type)
    else:
        kwargs["default"] = spec.shown(default) if spec.shown is not None else default
        kwargs["type"] = spec.type or (type(default) if isinstance(default, (int, float)) else None)
    if spec.choices is not None:
        kwargs["choices"] = list(spec.choices)
    parser.add_argument(option.name, **kwargs)


def comma_separated(text: str) -> tuple[str, ...]:
    """A flag's comma-separated list as a tuple, blanks around and between the commas dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
