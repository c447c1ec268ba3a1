"""The one user-error type and the command-line boundary every `python -m pose_mlx.*` command shares.

Contract of a command: input the user can fix raises `UserError` anywhere below the command; `command(prog)`
turns it into ONE line on stderr, ``prog: error: message``, and exit code 2. Ctrl-C outside a training loop
prints one line and exits with 130; so does work stopped by a signal after saving its state (`Stopped`: the
training loop's `Interrupted` is one), with 128 + the signal's number. Output piped into a reader that leaves
early (`| head -1`) ends the command quietly with exit code 141, as if SIGPIPE had ended it (what a shell reports
for `yes | head -1`; Python ignores the signal and raises `BrokenPipeError` instead): stdout is pointed at
/dev/null so that nothing fails again when Python flushes it at exit. A full or read-only disk (and a permission denied) is the user's
environment, not a bug: one line and exit code 2 as well; so is a path that cannot exist (a part of it is a file). Every other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import re
import select
import sys
from typing import Callable

#: errno values of OSError that describe the user's machine (disk full, read-only, permissions), not a bug.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT})
#: errno values of OSError that describe a path the user gave which cannot exist (a part of it is a file, or it
#: is too long): commands check their outputs up front (`pose_mlx.places`); this is the boundary's safety net.
PATH_ERRNOS = frozenset({errno.ENOTDIR, errno.ENAMETOOLONG})
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
#: 128 + SIGPIPE (13): the exit code of a command whose output pipe was closed by its reader.
EXIT_BROKEN_PIPE = 141


class UserError(Exception):
    """Bad input the user can fix (a flag, a file, a model, a setting): reported as one line, exit code 2."""


class Stopped(Exception):
    """Work stopped by a signal after saving its state (a checkpoint); rerunning resumes it. One line on stderr,
    exit code 128 + `signum`, like a shell's. Work shared by several processes (data-parallel ranks) says it on
    one of them (`announce` False on the others), and `settle()` holds each process's exit until that line is out
    (an outside launcher ends the whole group as soon as one process exits with an error)."""

    announce = True

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    def settle(self) -> None:
        """Called by `command` after the line is printed, before the exit code is returned: nothing to wait for
        in one process."""


def one_line(message: object) -> str:
    """`message` folded onto one line (newlines and runs of spaces become single spaces)."""
    return " ".join(str(message).split())


#: The end of a description that names its own command: ": `python -m pose_mlx.X ...`." (see `ArgumentParser`).
_OWN_COMMAND = re.compile(r":\s*`python -m [^`]*`\.?\s*$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, bad value, missing argument) raise `UserError` instead of printing
    the whole usage block and exiting, and which refuses an argument that is not valid UTF-8 (bytes the
    interpreter could only decode as surrogates: such a path could not be written into the JSON, logs and
    messages the commands write). What follows a `--` is passed on untouched (`pose_mlx.launch`'s command).
    A description that ends by naming its own command (a module docstring's first line, "...: `python -m
    pose_mlx.passkey`.") ends at the sentence instead: the usage line above it names the command."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.description:
            self.description = _OWN_COMMAND.sub(".", self.description)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        for i, arg in enumerate(args):
            if arg == "--":
                break
            if isinstance(arg, str) and not is_utf8(arg):
                flag, _, value = arg.partition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
                if not flag and i and str(args[i - 1]).startswith("-"):
                    flag = args[i - 1]
                shown = ascii(os.fsencode(value))[1:]  # b'\xffdir' -> '\xffdir', one printable line
                raise UserError(f"{flag or 'argument'} {shown} is not valid UTF-8; rename it or use "
                                "another path")
        return super().parse_known_args(args, namespace)

    def error(self, message):
        raise UserError(message)


def is_utf8(text: str) -> bool:
    """Whether `text` is valid Unicode: a command-line argument with bytes that are not UTF-8 is decoded into
    lone surrogates, which no UTF-8 file can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def command(prog: str) -> Callable:
    """Decorator of a CLI entry point `main(argv) -> int | None`: the one place user errors become exit codes."""

    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def main(argv=None) -> int:
            try:
                code = func(argv) or 0
                sys.stdout.flush()  # a reader that left shows here, not in Python's flush at exit
                return code
            except BrokenPipeError:
                if not _stdout_widowed():
                    raise
                _stdout_to_devnull()
                return EXIT_BROKEN_PIPE
            except UserError as error:
                _report(prog, error)
                return EXIT_USER_ERROR
            except OSError as error:
                if error.errno not in ENVIRONMENT_ERRNOS | PATH_ERRNOS:
                    raise
                _report(prog, f"{error.strerror}: {error.filename}" if error.filename else error.strerror)
                return EXIT_USER_ERROR
            except Stopped as stop:
                if stop.announce:
                    _report(prog, stop, kind="stopped")
                stop.settle()
                return 128 + stop.signum
            except KeyboardInterrupt:
                _report(prog, "interrupted", kind="stopped")
                return EXIT_INTERRUPTED

        return main

    return wrap


def _stdout_widowed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has closed it: poll reports an error or a hang-up."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no file descriptor (replaced, closed): not a pipe we wrote
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _fd, events in poller.poll(0))


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null: what is still buffered is flushed there at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _report(prog: str, message: object, kind: str = "error") -> None:
    try:
        print(f"{prog}: {kind}: {one_line(message)}", file=sys.stderr, flush=True)
    except OSError:  # stderr is gone (a closed pipe): the exit code still tells
        pass


__all__ = ["ArgumentParser", "EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "EXIT_USER_ERROR", "Stopped", "UserError", "command", "is_utf8",
           "one_line"]
