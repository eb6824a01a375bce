"""The command line: parse arguments, make one :mod:`resumerge.api` call per command, map errors to exit codes.

The only module that knows about argv (each command's parser is in :mod:`resumerge.cli.parsers`); what a run is, and
every guard on its options, is decided in the API.
Heavy modules (sqlite-utils) are imported inside the commands that merge, and torch on its first use
(:mod:`resumerge.machine.torch_import`), so ``resumerge status`` stays fast and a run starts its downloads before torch.
Exit codes: 0 done, 1 internal error, 2 invalid input, 3 interrupted and resumable, 4 refused (see
:data:`resumerge.errors.EXIT_CODES`); ``check`` ends with its verdict's: 5 no effect, 6 broken.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from resumerge.cli.flags import api_options
from resumerge.cli.knobs import (
    Progress,
    fits_exit_code,
    installed_stop_flag,
    quiet_hub_uploads,
)
from resumerge.cli.parsers import asked_command, build_parser, command_parser, commands
from resumerge.errors import EXIT_INTERRUPTED, EXIT_OK, ResumergeError, UsageError, exit_code_for

if TYPE_CHECKING:
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.api.options import Settings
    from resumerge.merge.engine.drive import Outcome

# What a shell shows for a process that SIGPIPE ended (128 + 13): a closed pipe is no error of ours.
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``resumerge`` console script; returns the exit code."""
    parser = build_parser(asked_command(argv))
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        if words[:1] == ["lm-eval"]:  # the rest is lm-eval's, parsed by lm-eval's own parser (.lmevalcmd)
            args = argparse.Namespace(command="lm-eval", words=words[1:])
        else:
            args, extra = parser.parse_known_args(argv)
            if extra:  # a command's unknown option: its own usage, not the top-level one parse_args would print
                command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse already printed its message
        return 2 if exc.code not in (0, None) else 0
    if args.command is None:
        parser.print_help()
        return 2
    if "torch" not in sys.modules:
        # torch reads this once, at its first allocation: tensors of 2 MiB and more are then aligned to, and
        # faulted in as, transparent huge pages where the kernel offers them (madvise). A merge allocates its
        # buffers afresh for every tensor, and their 4 KiB page faults cost a della merge of 5 GB of inputs 1.7 s
        # of system time (bench/RESULTS.md); where huge pages are off this changes nothing. A notebook that
        # imported torch first keeps its own setting.
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    try:
        code = _dispatch(args)
        sys.stdout.flush()  # a closed pipe shows here when the output was small enough to sit in the buffer
        return code
    except BrokenPipeError:
        # The reader went away (`resumerge status OUT --json | head`): end quietly, as Unix tools do. stdout is
        # pointed at /dev/null so that the interpreter's own flush at exit does not raise a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except ResumergeError as exc:
        from resumerge.cli.render import show_error

        show_error(_naming_out(exc.one_line(), args))
        return exit_code_for(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: one line, and the traceback only on request
        if os.environ.get("RESUMERGE_DEBUG"):
            import traceback

            traceback.print_exc()
        print(f"error: internal error: {type(exc).__name__}: {exc} (set RESUMERGE_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


def _naming_out(line: str, args: argparse.Namespace) -> str:
    """``line`` with the placeholder of a "resumerge resume OUT" hint made the command that resumes this run
    (the layers below that word the hint know the file that failed, not the OUT it was given as)."""
    out = getattr(args, "out", None)
    if out is None or args.command not in ("run", "resume", "extract-lora", "tokensurgeon"):
        return line
    from resumerge.config.locations import resume_command

    return line.replace("resumerge resume OUT", resume_command(out, args.state_dir))


def entry() -> NoReturn:
    """The ``resumerge`` console script and ``python -m resumerge``: :func:`main`, then :func:`exit_with` its code."""
    exit_with(main())


def exit_with(code: int) -> NoReturn:
    """End the process with ``code``, the exit code a command returned.

    A command that returns 0 has nothing left to do: every file it wrote is durable and recorded (a merge returns
    only then; a hub OUT's last commit has been answered). The interpreter's own teardown would still take most
    of a second with torch loaded (collecting every object, unloading torch's operator libraries: 0.4-0.9 s
    measured here per process), so after the logs and the standard streams are flushed the process ends at once.
    Any other code exits normally (a stopped run may still be winding down transfers it chose to abandon: its
    threads are joined, its exit handlers run) but for the collection of every object it holds, which is most of
    that teardown: an evaluation stopped by Ctrl-C or refused took 1.0-1.25 CPU s to end after its last line
    (lm-eval's, datasets', transformers' and torch's objects collected), 0.2-0.3 s with them frozen; seconds of
    wall on a loaded machine before the shell got its prompt back."""
    if code == EXIT_OK:
        logging = sys.modules.get("logging")  # not imported (status, verify): no handler to flush
        if logging is not None:
            logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a reader gone or a closed stream: nothing to deliver
                stream.flush()
        os._exit(EXIT_OK)
    import gc

    gc.disable()
    gc.freeze()  # what the process holds is left as it is: only the teardown's own garbage is collected
    sys.exit(code)


def _dispatch(args: argparse.Namespace) -> int:
    command = commands().get(args.command)
    if command is None:
        raise UsageError(f"unknown command {args.command}")
    return command.run(args)


def _reading(args: argparse.Namespace) -> Settings | None:
    """``--state-dir`` as the settings ``status`` and ``verify`` take; None without it: the option groups' module is
    then never imported (issue 72: status under 0.2 s)."""
    if args.state_dir is None:
        return None
    from resumerge.api import Settings

    return Settings(state_dir=args.state_dir)


def _status(args: argparse.Namespace) -> int:
    from resumerge.api import status

    report = status(args.out, _reading(args))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        from resumerge.cli.statusshow import show_any_status

        show_any_status(report)
    return EXIT_OK


def _verify(args: argparse.Namespace) -> int:
    from resumerge.api import verify
    from resumerge.merge.store.integrity import report_json

    report = verify(args.out, _reading(args))
    if args.json:
        print(report_json(report))
    else:
        from resumerge.cli.render import show_verify

        show_verify(report)
    return EXIT_OK if report.ok else EXIT_INTERRUPTED


def _marked(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """The planning mark of the run into ``args.out``, taken before the merging modules are imported (a second
    or two), so that ``status`` says "planning" from the first second; the session's own mark is then this one."""
    from resumerge.config.locations import run_dir
    from resumerge.machine.planning import planning_mark

    try:
        where = run_dir(args.out, args.state_dir)
    except ResumergeError:  # a bad hf:// target: the run itself says so
        return contextlib.nullcontext()
    return planning_mark(where)


def _run(args: argparse.Namespace) -> int:
    with _marked(args):
        from resumerge.api import run
        from resumerge.cli.ignoredflags import note_ignored

        note_ignored(args)
        quiet_hub_uploads(args.out)
        with Progress(args.quiet) as progress:
            outcome = run(progress=progress, should_stop=installed_stop_flag(), **api_options(args, run))
    _finished(outcome, args.quiet)
    report = getattr(outcome, "check", None)  # run --check: the check's report, and its verdict's exit code
    if report is not None:
        from resumerge.cli.render import show_check

        show_check(report)
    return EXIT_OK if report is None else int(report.exit_code)


def _resume(args: argparse.Namespace) -> int:
    with _marked(args):
        from resumerge.api import resume

        quiet_hub_uploads(args.out)
        with Progress(args.quiet) as progress:
            outcome = resume(progress=progress, should_stop=installed_stop_flag(), **api_options(args, resume))
    _finished(outcome, args.quiet)
    return EXIT_OK


def _plan(args: argparse.Namespace) -> int:
    from resumerge.api import estimate

    result = estimate(fresh_process=True, **api_options(args, estimate))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        from resumerge.cli.render import show_estimate

        show_estimate(result)
    return fits_exit_code(result.fits, result.reasons)


# The options of extract-lora and tokensurgeon that only writing uses: --plan estimates without them.
EXTRACTION_RUN_ONLY = frozenset({"plan", "restart", "max_gpu_memory", "public", "commit_every", "commit_interval"})


def _extract_lora(args: argparse.Namespace) -> int:
    from resumerge.api import estimate_extraction, extract_lora

    return _written_or_estimated(args, extract_lora, estimate_extraction)


def _tokensurgeon(args: argparse.Namespace) -> int:
    from resumerge.api import estimate_tokensurgeon, tokensurgeon

    return _written_or_estimated(args, tokensurgeon, estimate_tokensurgeon)


def _written_or_estimated(args: argparse.Namespace, write: Callable[..., Outcome | Estimate],
                          estimate: Callable[..., Estimate]) -> int:
    """A command that writes a model (extract-lora, tokensurgeon): ``write`` it, or with ``--plan`` print what
    ``estimate`` says it needs and exit with whether it fits."""
    from resumerge.analyses.estimate.costs import Estimate
    from resumerge.cli.ignoredflags import note_ignored

    note_ignored(args)
    if not args.plan:
        quiet_hub_uploads(args.out)
        with Progress(args.quiet) as progress:
            outcome = write(progress=progress, should_stop=installed_stop_flag(), **api_options(args, write))
        assert not isinstance(outcome, Estimate)  # plan=False writes
        _finished(outcome, args.quiet)
        return EXIT_OK
    result = estimate(fresh_process=True, **api_options(args, estimate, EXTRACTION_RUN_ONLY))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        from resumerge.cli.render import show_estimate

        show_estimate(result)
    return fits_exit_code(result.fits, result.reasons)


def _finished(outcome: Outcome, quiet: bool) -> None:
    if quiet:
        return
    if outcome.detail:
        done = f" ({outcome.detail})"
    else:
        done = f" ({outcome.resumed_files} files were already committed)" if outcome.resumed_files else ""
    print(f"done: {outcome.target or outcome.out_dir}{done}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

