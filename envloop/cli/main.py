"""The ``envloop`` command.

    envloop run CONFIG.yaml [key=value ...] [--quiet] [--resume]
                                                        roll out, write a run directory
    envloop envs [NAME ...]                             registered environments and configs
    envloop check-env module:Class [--config ...]       check an environment's contract
    envloop report RUN_DIR                              rebuild RUN_DIR/report.html
    envloop reverify RUN_DIR                            re-score stored rollouts

Exit status: 0 on success, 1 when the work failed (a broken environment, a failed run),
2 for a bad command line or config, 130 / 143 for a run stopped by Ctrl-C / SIGTERM (it
prints the command that resumes it).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envloop.config.errors import ConfigError
from envloop.run.termination import RunTerminated


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args = parse_args(parser, argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return int(exc.code or 0)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # module:Class paths import from here, as with python -m
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(f"envloop {args.command}: {config_error_text(exc)}", file=sys.stderr)
        return 2
    except RunTerminated as exc:  # SIGTERM during a run
        print(f"\nenvloop {args.command}: {exc}", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"\nenvloop {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (envloop envs | head): not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (so the exit-time flush is silent)
        return 0
    except (OSError, ImportError, RuntimeError, ValueError) as exc:
        print(f"envloop {args.command}: error: {_one_line(str(exc))}", file=sys.stderr)
        return 1


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``argv`` parsed; ``run``'s ``key=value`` overrides may also follow its options
    (``envloop run c.yaml -q rollout.max_turns=2``)."""
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "command", None) == "run":
        args.overrides += [item for item in extra if "=" in item and not item.startswith("-")]
        extra = [item for item in extra if item not in args.overrides]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def config_error_text(exc: ConfigError) -> str:
    """``exc`` as printed: one line for one problem, else a line per problem.

    >>> config_error_text(ConfigError("run config", ["rollout.max_turns: expected int"]))
    'invalid run config: rollout.max_turns: expected int'
    """
    if len(exc.problems) == 1:
        return f"invalid {exc.what}: {exc.problems[0]}"
    return str(exc)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subcommand sets ``handler`` (a function of the args)."""
    from envloop.cli import envs as cli_envs

    parser = argparse.ArgumentParser(
        prog="envloop",
        description=_plain(__doc__.split("\n")[0]),
        epilog=_plain(__doc__.split("\n\n")[2].strip()),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="roll out a policy against environments")
    run.add_argument("config", help="YAML config (see docs/config-reference.md)")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. rollout.max_turns=4")
    run.add_argument("-q", "--quiet", action="store_true", help="log lines, no live progress bar")
    run.add_argument(
        "--resume",
        action="store_true",
        help="keep the finished samples of the run in output.dir, roll out only the others",
    )
    run.set_defaults(handler=_run)

    envs = commands.add_parser("envs", help="list registered environments and their configs")
    envs.add_argument("names", nargs="*", help="only these environments")
    envs.set_defaults(handler=cli_envs.list_command)

    check = commands.add_parser("check-env", help="run the environment contract checker")
    check.add_argument("target", help="module:Class, or a registered environment name")
    check.add_argument("--config", help="the environment's config as YAML/JSON text or a file")
    check.add_argument(
        "--sample-jsonl", help='samples, one per line: {"messages": [...], "metadata": {...}}'
    )
    check.add_argument("--ray", action="store_true", help="also check it as a Ray actor")
    check.set_defaults(handler=cli_envs.check_command)

    report = commands.add_parser("report", help="rebuild RUN_DIR/report.html")
    report.add_argument("run_dir")
    report.set_defaults(handler=_report)

    reverify = commands.add_parser("reverify", help="re-score stored rollouts, show changes")
    reverify.add_argument("run_dir")
    reverify.set_defaults(handler=_reverify)
    return parser


def _plain(text: str) -> str:
    """Docstring text as a terminal shows it: ``literal`` markup dropped."""
    return text.replace("``", "")


def _run(args: argparse.Namespace) -> int:
    """Validate the config, then the prompts against the policy's tokenizer, and only then
    import the rollout machinery (torch, the policy, Ray) and run: a bad run fails fast."""
    from envloop.run.config import load_run_config
    from envloop.run.preflight import prepare_inputs

    config = load_run_config(args.config, args.overrides)  # torch only once otherwise valid
    inputs = prepare_inputs(config)  # prompts, tokenizer and lengths, before Ray
    from transformers.utils import logging as hf_logging

    from envloop.run.metrics import summary_table
    from envloop.run.runner import run
    from envloop.run.termination import RunStopped, signals_stop_the_run

    hf_logging.disable_progress_bar()  # our own progress is the one to watch
    resume = resume_command(args)
    try:
        with signals_stop_the_run(resume):
            result = run(config, quiet=args.quiet, inputs=inputs, resume=args.resume)
    except RunStopped as stop:
        print(
            f"\nenvloop run: {stop}: {stop.finished} of {stop.total} samples finished, kept in "
            f"{stop.run_dir}\nenvloop run: resume with: {resume}",
            file=sys.stderr,
        )
        return stop.exit_status
    except KeyboardInterrupt as exc:  # while starting up (RunTerminated: SIGTERM)
        status = 143 if isinstance(exc, RunTerminated) else 130
        said = str(exc) if isinstance(exc, RunTerminated) else "interrupted (Ctrl-C)"
        print(f"\nenvloop run: {said}", file=sys.stderr)
        from envloop.run.journal import JOURNAL_DIR, RUN_FILE

        if (Path(config.output.dir) / JOURNAL_DIR / RUN_FILE).is_file():
            print(f"envloop run: resume with: {resume}", file=sys.stderr)
        return status
    print(summary_table(result.stats))
    print(f"run directory: {result.run_dir}")
    build_report = _optional_import("envloop.report.page", "build_report")
    if build_report is None:
        print("report.html: not built (envloop.report.page is not available)")
    else:
        print(f"report: {build_report(result.run_dir)}")
    return 0


def resume_command(args: argparse.Namespace) -> str:
    """The command line that resumes the run ``args`` describe (``envloop run``'s).

    >>> resume_command(argparse.Namespace(config="my run.yaml", overrides=["a.b=1"],
    ...                                   quiet=True))
    "envloop run 'my run.yaml' a.b=1 --quiet --resume"
    """
    quiet = ["--quiet"] if args.quiet else []
    return shlex.join(["envloop", "run", args.config, *args.overrides, *quiet, "--resume"])


def _report(args: argparse.Namespace) -> int:
    build_report = _optional_import("envloop.report.page", "build_report")
    if build_report is None:
        print(
            "envloop report: envloop.report.page is not available in this install", file=sys.stderr
        )
        return 1
    print(f"report: {build_report(args.run_dir)}")
    return 0


def _reverify(args: argparse.Namespace) -> int:
    reverify_run = _optional_import("envloop.report.reverify", "reverify_run")
    if reverify_run is None:
        print(
            "envloop reverify: envloop.report.reverify is not available in this install",
            file=sys.stderr,
        )
        return 1
    summary = reverify_run(args.run_dir)
    describe = _optional_import("envloop.report.reverify", "format_reverify")
    if describe is not None:
        print(describe(summary))
    else:
        import json

        print(json.dumps(summary, indent=2, default=str))
    return 0


def _optional_import(module: str, name: str) -> Any:
    """``module.name``, or None when the module is not there (other import errors raise)."""
    import importlib

    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return None
    return getattr(loaded, name, None)


if __name__ == "__main__":
    sys.exit(main())
