"""Writes docs/cli-reference.md from the parsers of the commands in pyproject.toml's [project.scripts]
(`python scripts/gen_cli_reference.py`; `--check` exits 1 when the committed page differs)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGE = REPO_ROOT / "docs" / "cli-reference.md"

# What encoder_common.env_flags appends to every option's help.
_ENV_SUFFIX = re.compile(r"\s*\[env (?P<env>[A-Z0-9_]+); default: .*\]\s*$", re.S)

HEADER = """\
# CLI reference

Generated from the commands' own parsers by `python scripts/gen_cli_reference.py`; do not edit by
hand (`tests/project/test_docs.py` fails when this page and the parsers disagree). Every option also reads
an environment variable (named once per command): the variable sets the default, a flag on the command line wins.
Boolean flags read `1`, `true` or `yes` as on. `--help` on each command says the same.
"""


def console_scripts(pyproject: Path = REPO_ROOT / "pyproject.toml") -> dict[str, str]:
    """Command name -> "module:function", in the order pyproject.toml lists them."""
    return tomllib.loads(pyproject.read_text())["project"].get("scripts", {})


def build_parser(entry_point: str) -> argparse.ArgumentParser:
    module_name = entry_point.split(":")[0]
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(module_name).build_parser()


@contextlib.contextmanager
def environment_without(names: set[str]) -> Iterator[None]:
    """The parsers take their defaults from the environment; the page shows the declared ones."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def env_and_help(action: argparse.Action) -> tuple[str | None, str]:
    """The environment variable named in the option's help, and the help without that suffix, with
    argparse's %(default)s-style fields filled in as --help fills them."""
    text = action.help or ""
    params = dict(vars(action))
    if action.choices is not None:
        params["choices"] = ", ".join(map(str, action.choices))
    try:
        text = text % params
    except (KeyError, TypeError, ValueError):
        pass  # not a format string: shown as written
    match = _ENV_SUFFIX.search(text)
    if match is None:
        return None, text.strip()
    return match.group("env"), text[: match.start()].strip()


def invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        name = action.metavar or action.dest
        return f"{name} ..." if action.nargs in ("+", "*", argparse.REMAINDER) else name
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    if action.choices:
        return f"{names} " + "{" + ",".join(map(str, action.choices)) + "}"
    return names  # the value's name is the option's own, in capitals: no need to print it


def default_text(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default is None:
        return "—"
    if action.default == "":
        return '`""`'
    return f"`{action.default}`"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell (and outside one: no stray HTML tags)."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += list(action.choices.items())
    return found


def env_names(parser: argparse.ArgumentParser) -> set[str]:
    names = {env for a in parser._actions if (env := env_and_help(a)[0])}
    for _, sub in subcommands(parser):
        names |= env_names(sub)
    return names


def env_prefix(options: list[argparse.Action]) -> str | None:
    """The prefix every option's environment variable shares with its long name in capitals, if one does."""
    prefixes = set()
    for action in options:
        env = env_and_help(action)[0]
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if env is None or flag is None:
            return None
        stem = flag[2:].upper().replace("-", "_")
        if not env.endswith(stem):
            return None
        prefixes.add(env[: -len(stem)])
    return prefixes.pop() if len(prefixes) == 1 else None


def render_parser(title: str, parser: argparse.ArgumentParser, level: int, entry_point: str = "") -> list[str]:
    lines = [f"{'#' * level} `{title}`", ""]
    if parser.description:
        lines += [cell(parser.description), ""]
    if entry_point:
        lines += [f"Entry point: `{entry_point}`.", ""]
    positionals = [
        a for a in parser._actions
        if not a.option_strings and a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction)
    ]
    if positionals:
        lines += ["| argument | meaning |", "| --- | --- |"]
        lines += [f"| `{invocation(a)}` | {cell(env_and_help(a)[1])} |" for a in positionals]
        lines.append("")
    options = [
        a for a in parser._actions
        if a.option_strings and a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
    ]
    if options:
        prefix = env_prefix(options)
        if prefix:
            lines += [f"Each option also reads `{prefix}` and its name in capitals (`--flag-name`: `{prefix}FLAG_NAME`).", ""]
            lines += ["| option | default | meaning |", "| --- | --- | --- |"]
        else:
            lines += ["| option | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
        for action in options:
            env, text = env_and_help(action)
            env_cell = "" if prefix else (f"`{env}` | " if env else "— | ")
            lines.append(f"| `{cell(invocation(action))}` | {env_cell}{cell(default_text(action))} | {cell(text)} |")
        lines.append("")
    for name, sub in subcommands(parser):
        lines += render_parser(f"{title} {name}", sub, level + 1)
    return lines


def render() -> str:
    lines = [HEADER]
    for command, entry_point in console_scripts().items():
        names = env_names(build_parser(entry_point))
        with environment_without(names):
            parser = build_parser(entry_point)
        lines += render_parser(command, parser, 2, entry_point)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date; write nothing")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page (default: docs/cli-reference.md)")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"{args.out} is out of date: run python scripts/gen_cli_reference.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
