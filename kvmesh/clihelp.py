"""Help conventions for every `kvmesh` command: each flag says what it does and its default.

`DefaultsFormatter` appends "(default: X)" to a value-taking flag whose help does not
already name its default; flags whose default comes from a `KVMESH_*` variable say so
in their help (`env_default`), since their parser default is None ("not given").
`kvmesh.launch.cli.build_parser` sets the formatter on every sub-command's parser.
"""

from __future__ import annotations

import argparse
import dataclasses


class DefaultsFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in text.lower()
                or action.default in (None, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)"


def env_default(cfg_cls, prefix: str, name: str) -> str:
    """'default $<PREFIX><NAME> or <field default>' for a config dataclass field."""
    f = next(f for f in dataclasses.fields(cfg_cls) if f.name == name)
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return f"default ${prefix}{name.upper()} or {value}"


def walk(parser: argparse.ArgumentParser):
    """The parser and every sub-command parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from walk(sub)
