"""`python -m lucebox.clients install|run|probe`: the same as `python -m lucebox clients ...`."""

import sys

from lucebox.cli import _lazy, build_parser
from lucebox.clients.cli import add_clients_parser
from lucebox.errors import LuceboxError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
    if "clients" not in sub.choices:
        add_clients_parser(sub, _lazy)
    args = parser.parse_args(["clients", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except LuceboxError as exc:
        print(f"lucebox: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


sys.exit(main())
