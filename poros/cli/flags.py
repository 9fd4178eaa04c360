"""The command-line flags of the settings table (poros/settings.py): one flag per setting, unset unless given, its
help naming the default the run would take (the device's, poros/resolve.py, where it has one)."""

from __future__ import annotations

from poros import resolve
from poros.settings import COMPUTED, RUN, SCHEDULE, SETTINGS


def add_arguments(parser, kinds=(COMPUTED, SCHEDULE, RUN), defaults: dict | None = None,
                  default_text: dict | None = None) -> None:
    """Command-line flags for the settings of `kinds` (each flag's default is None: unset). `defaults`
    shows other default values, `default_text` words them (a command whose defaults depend on the device)."""
    for s in SETTINGS:
        if not s.cli or s.kind not in kinds:
            continue
        if default_text and s.name in default_text:
            shown = default_text[s.name]
        elif defaults and s.name in defaults:
            shown = s.show(defaults[s.name])
        else:
            shown = resolve.default_text(s.name) or s.default_help or s.show(s.default)
        help_ = f"{s.help} (default: {shown})"
        if s.is_flag:
            parser.add_argument(s.flag, dest=s.name, default=None, action="store_const", const=True, help=help_)
            if resolve.has_off_flag(s.name):
                parser.add_argument("--no-" + s.flag[2:], dest=s.name, action="store_const", const=False,
                                    help=f"turn off {s.flag}")
        else:
            parser.add_argument(s.flag, dest=s.name, default=None, metavar=s.metavar or s.name.upper(),
                                type=s.type if s.type in (int, float) else str,
                                help=help_)


def from_arguments(args) -> dict:
    """The settings given on the command line (flags left unset are absent)."""
    return {s.name: getattr(args, s.name) for s in SETTINGS if getattr(args, s.name, None) is not None}
