"""The `tlaloc` command: export, compile, run, repository, serve, check-stubs, generate, openai.
The arguments are parsers.py's, what each subcommand does commands.py's."""

from __future__ import annotations

import logging
import sys

from .parsers import build_parser


def _dispatch(args) -> int:
    """Runs the subcommand; a refusal it reports (bad artifact, checkpoint, request, file,
    server or value) is one line on stderr and exit status 2, not a traceback."""
    # The artifact's, checkpoint's, export's and request's errors are ValueErrors (their
    # modules are not imported here: `tlaloc run --stdlib` imports no numpy).
    from ..triton.server import ServerError

    try:
        return args.fn(args)
    except (FileNotFoundError, ServerError, ValueError) as e:
        print(f"tlaloc {args.command}: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("triton_tlaloc").setLevel(logging.INFO if args.verbose else logging.WARNING)
    return _dispatch(args)
