"""The ``streamcache`` command: a thin adapter over typed library functions.

Each subcommand lives in the module of the part it belongs to, which provides
``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen subcommand's module is
imported, so ``streamcache inspect`` does not pay for importing torch.

A failure is one line on stderr and exit 1; bad usage exits 2. That holds for a
:class:`~streamcache.errors.StreamcacheError` and for the storage layer's own errors beneath
it (missing credentials, an unreachable endpoint, a missing or forbidden object), which
:func:`storage_failure` words here, at the boundary. Any other exception is a bug and keeps
its traceback. Output into a closed pipe (``| head``) ends quietly. pynvml 13's deprecation
warning, which torch's import of it gives where the resilience extra is installed, is not
printed (:data:`PYNVML_DEPRECATION`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

from ..errors import StreamcacheError

# Exception class names (anywhere in the MRO) of the cloud clients beneath fsspec, matched by
# name so that the CLI imports none of them.
_CREDENTIAL_ERRORS = frozenset({"NoCredentialsError", "PartialCredentialsError",
                                "CredentialRetrievalError", "DefaultCredentialsError",
                                "ClientAuthenticationError"})
_CONNECTION_ERRORS = frozenset({"EndpointConnectionError", "ConnectTimeoutError",
                                "ConnectionClosedError", "ClientConnectorError",
                                "ServerTimeoutError", "ConnectionError", "TimeoutError"})
_CLIENT_ERRORS = frozenset({"ClientError", "BotoCoreError", "ClientResponseError",
                            "HttpResponseError"})

#: The start of pynvml 13's FutureWarning on import. nvidia-resiliency-ext (the resilience
#: extra) installs pynvml 13, and torch imports pynvml on ``import torch``: every command that
#: needs torch would print two lines of a warning about the environment before its own.
PYNVML_DEPRECATION = "The pynvml package is deprecated"

# name -> (module providing add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("streamcache.cli.convert",
                "convert Parquet/Arrow/JSONL/images/numpy into shards"),
    "index": ("streamcache.cli.index",
              "build index.json for existing Parquet or Arrow IPC files"),
    "inspect": ("streamcache.cli.inspection", "show a dataset's schema, shards, sizes and samples"),
    "bench": ("streamcache.cli.bench", "stream a dataset and report throughput and waiting"),
    "checkpoints": ("streamcache.checkpoint", "list checkpoints under a root, or verify one"),
    "goodput": ("streamcache.cli.goodput", "checkpoint interval and expected goodput"),
}


def _build_parser(chosen: str | None,
                  ) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser | None]:
    """The top-level parser, and the chosen subcommand's (None when none is chosen)."""
    parser = argparse.ArgumentParser(
        prog="streamcache",
        description="Fast, exactly-once, resumable data streaming for PyTorch training.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"streamcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen_parser = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
            chosen_parser = sub_parser
    return parser, chosen_parser


def one_line(text: str) -> str:
    """``text`` with its lines joined, so that an error is one line whatever its source."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what caused it (``cause`` attributes, ``__cause__``, ``__context__``)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        cause = getattr(current, "cause", None)
        current = cause if isinstance(cause, BaseException) else (
            current.__cause__ or current.__context__)
    return seen


def storage_advice(exc: BaseException) -> str | None:
    """What to do about a credential or connection failure anywhere in ``exc``'s chain."""
    for link in _chain(exc):
        names = _class_names(link)
        if names & _CREDENTIAL_ERRORS:
            return ("no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                    "or AWS_PROFILE (S3), GOOGLE_APPLICATION_CREDENTIALS (GCS), or the Azure "
                    "equivalents, or use a public URL")
        if names & _CONNECTION_ERRORS:
            return ("the store cannot be reached: check the network, the URL and the endpoint "
                    "(AWS_ENDPOINT_URL), then retry")
    return None


def storage_failure(exc: BaseException, url: str | None) -> str | None:
    """One line about an error of the storage layer beneath streamcache (fsspec and the cloud
    clients), or None when ``exc`` is not one (a bug: keep its traceback)."""
    names = _class_names(exc)
    where = f"{url}: " if url else ""
    advice = storage_advice(exc)
    if advice is not None:
        return f"{where}{type(exc).__name__}: {one_line(str(exc))}; {advice}"
    if isinstance(exc, PermissionError) or "AccessDenied" in str(exc):
        return f"{where}permission denied: {one_line(str(exc))}"
    if isinstance(exc, FileNotFoundError):
        return f"{where}not found: {one_line(str(exc))}"
    if names & _CLIENT_ERRORS or isinstance(exc, OSError):
        return f"{where}storage error: {one_line(str(exc))}"
    return None


def _url_of(args: argparse.Namespace) -> str | None:
    for name in ("url", "src", "root"):
        value = getattr(args, name, None)
        if isinstance(value, str):
            return value
    return None


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (``| head``): stop without a traceback, and keep
    Python's final flush from raising again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # what a shell reports for a process ended by SIGPIPE


@contextlib.contextmanager
def _without_pynvml_deprecation() -> Iterator[None]:
    """Ignore pynvml 13's deprecation warning when torch imports it, and no other warning;
    the filters are as they were afterwards (``main`` may be called in a process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PYNVML_DEPRECATION, category=FutureWarning,
                                module="torch")
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    with _without_pynvml_deprecation():
        return _main(list(sys.argv[1:] if argv is None else argv))


def _main(args_list: list[str]) -> int:
    """Parse ``args_list`` and run the chosen subcommand; its exit code, or 1 with one line
    on stderr for a failure the module docstring describes."""
    chosen = next((a for a in args_list if not a.startswith("-")), None)
    parser, sub_parser = _build_parser(chosen if chosen in SUBCOMMANDS else None)
    args, unknown = parser.parse_known_args(args_list)
    if unknown:  # a mistyped flag of the subcommand: its own usage, not the top-level one
        (sub_parser or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        code = int(args._run(args))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at exit
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except StreamcacheError as exc:
        advice = storage_advice(exc)
        return _fail(args.command, one_line(str(exc)) + (f"; {advice}" if advice else ""))
    except KeyboardInterrupt:
        print(f"streamcache {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = storage_failure(exc, _url_of(args))
        if message is None:
            raise
        return _fail(args.command, message)


def _fail(command: str, message: str) -> int:
    print(f"streamcache {command}: error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
