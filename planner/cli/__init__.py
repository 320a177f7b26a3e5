"""The ``hybridflow`` command line.

Bad input ends with one line naming the file, the key and the problem, and exit status 2; a
job or plan that does not fit ends with the numbers that show why and exit status 1.
"""

from __future__ import annotations

import os
import sys

import click

from planner.cli import calibrate, estimate, execute, listing, plan, simulate, validate
from planner.cli.common import EXIT_BAD_INPUT, cli
from planner.cli.execute import learning_rates
from planner.export.command import export
from planner.export.import_command import import_launch
from profiles.datafile import SpecError

__all__ = ["cli", "learning_rates", "main"]
# The commands register themselves on ``cli`` when their modules load.
_COMMANDS = (calibrate, estimate, execute, listing, plan, simulate, validate)

cli.add_command(export)
cli.add_command(import_launch)


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the CLI and turns input errors into one-line messages."""
    try:
        cli.main(args=argv, prog_name="hybridflow", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        # One line, like every other bad input (click's own show() adds the usage block).
        command = exc.ctx.command_path if exc.ctx else "hybridflow"
        click.echo(f"hybridflow: error: {exc.format_message()} "
                   f"(see `{command} --help`)", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except click.ClickException as exc:
        exc.show()
        sys.exit(EXIT_BAD_INPUT if exc.exit_code == 2 else exc.exit_code)
    except SpecError as exc:
        click.echo(f"hybridflow: error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as exc:
        click.echo(f"hybridflow: error: {exc.filename or ''}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:
        if os.environ.get("HYBRIDFLOW_DEBUG"):
            raise
        click.echo(f"hybridflow: internal error: {type(exc).__name__}: {exc} "
                   "(set HYBRIDFLOW_DEBUG=1 for the traceback)", err=True)
        sys.exit(3)
