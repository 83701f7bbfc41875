"""The `roving` command: run a program as a cluster job, list, read and cancel jobs, and show the backend.

    roving run [--backend B] [--cpu N --memory M --gpu G] [--build] [--dashboard] script.py args...
    roving ps | roving logs JOB | roving cancel JOB... | roving cancel --all | roving info
    roving pipeline plan ...
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import unicodedata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the modules are imported when a command runs: `roving --help` stays quick
    from .config import Config


#: Unicode categories never written to the terminal as they are: controls (ESC, CSI, BEL, carriage
#: return...), format characters (bidirectional overrides, zero-width ones), lone surrogates, line and
#: paragraph separators.
_HIDDEN = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _shown(text: object, keep: str = "") -> str:
    """``text`` made safe to print: what a job name, a cluster's answer, a worker's report or a child's
    output holds comes from others, and a terminal obeys the escape sequences in it (it can be made to
    rewrite the screen, set the window title, hide lines). Every control or format character is written
    visibly instead (``\\x1b``, ``\\u202e``), except those in ``keep`` (the newlines and tabs of output)."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c in keep or unicodedata.category(c) not in _HIDDEN else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None,
                   help="local, slurm, docker, kubernetes or auto (default: the `backend` option, else auto)")


def _configure(args: argparse.Namespace, **extra: Any) -> Config:
    from . import config

    options = {k: v for k, v in extra.items() if v is not None}
    if getattr(args, "backend", None):
        options["backend"] = args.backend
    return config.init(**options)


def _chosen_why(cfg: Config) -> str:
    from . import backends, config

    if os.environ.get("ROVING_BACKEND"):
        return f"ROVING_BACKEND={os.environ['ROVING_BACKEND']}"
    values, source = config.file_options(os.getcwd())
    if "backend" in values:
        return f"backend = {values['backend']!r} in {source}"
    name, why = backends.detect()
    return f"detected: {why}" if name == cfg.backend else "given on the command line"


def build_parser() -> argparse.ArgumentParser:
    """The `roving` command's parser, every subcommand included (the documentation's CLI page is made from it)."""
    parser = argparse.ArgumentParser(prog="roving", description="roving: multiprocessing on cluster backends")
    subparsers = parser.add_subparsers(dest="command", required=True)

    p = subparsers.add_parser("run", help="run a Python program as a job of the cluster, streaming its output")
    _backend_arg(p)
    p.add_argument("--cpu", type=float, default=None, help="CPUs for the program's job")
    p.add_argument("--memory", default=None, help="memory for the program's job, e.g. 4G")
    p.add_argument("--gpu", type=int, default=None, help="GPUs for the program's job")
    p.add_argument("--image", default=None, help="container image (docker, kubernetes)")
    p.add_argument("--build", action="store_true",
                   help="first build the image from ./Dockerfile with the working directory in it "
                        "(and push it when the `registry` option is set)")
    p.add_argument("--dashboard", action="store_true",
                   help="the program serves the live dashboard (the `dashboard` option); it prints its URL")
    p.add_argument("script", help="the program")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(handler=_run)

    p = subparsers.add_parser("ps", help="list the jobs of roving sessions")
    _backend_arg(p)
    p.set_defaults(handler=_ps)

    p = subparsers.add_parser("logs", help="print a job's output, or the last output of crashed children")
    _backend_arg(p)
    p.add_argument("job", nargs="?", help="job id as `roving ps` shows it")
    p.add_argument("--failed", action="store_true",
                   help="the last output of every child that crashed, kept on disk past its job (newest run "
                        "first; the latest 20 runs are kept)")
    p.set_defaults(handler=_logs)

    p = subparsers.add_parser("cancel", help="cancel jobs")
    _backend_arg(p)
    p.add_argument("jobs", nargs="*", help="job ids as `roving ps` shows them")
    p.add_argument("--all", action="store_true", help="every job of every roving session of this user")
    p.set_defaults(handler=_cancel)

    p = subparsers.add_parser("info", help="show the backend chosen, why, and the resources it sees")
    _backend_arg(p)
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="also start N workers on the backend and show each one's environment (Python, "
                        "platform, package versions) and how it differs from this machine's (env_check)")
    p.set_defaults(handler=_info)

    from roving.pipeline.run.cli import add_pipeline_parser

    add_pipeline_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `roving` command with ``argv`` (the process's arguments when None); return its exit code."""
    args = build_parser().parse_args(argv)
    from .backends import UnknownJobError

    try:
        return args.handler(args)
    except UnknownJobError as exc:
        print(f"roving: error: unknown job: {_shown(exc.args[0] if exc.args else exc)}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"roving: error: {_shown(exc, keep=chr(10))}", file=sys.stderr)
        return 2


def _build_image(cfg: Config) -> str:
    """`roving run --build`: the image of the working directory, built (and pushed to the `registry`
    option's registry) on the Docker engine; its tag."""
    import re

    from . import backends

    if not os.path.exists("Dockerfile"):
        raise OSError("--build needs a Dockerfile in the working directory (deploy/Dockerfile is an example)")
    # an image name allows only [a-z0-9._-], starting with a letter or digit
    name = re.sub(r"[^a-z0-9._-]+", "-", os.path.basename(os.getcwd()).lower()).lstrip("._-") or "app"
    tag = f"{cfg.registry.rstrip('/')}/roving-{name}:latest" if cfg.registry else f"roving-{name}:latest"
    from .backends.docker import DockerBackend

    docker = backends.get("docker")
    assert isinstance(docker, DockerBackend)
    print(f"roving: building {tag} from ./Dockerfile", file=sys.stderr)
    docker.build_image(tag, ".", buildargs={"WORKDIR": os.getcwd()})
    if cfg.registry:
        print(f"roving: pushing {tag}", file=sys.stderr)
        docker.push_image(tag)
    return tag


def _run(args: argparse.Namespace) -> int:
    from . import backends, config
    from .transport import session

    memory = args.memory
    if memory is not None:
        config.parse_memory(memory)
    cfg = _configure(args, cpu=args.cpu, memory=memory, gpu=args.gpu, image=args.image)
    if args.build:
        cfg = config.init(**{**_overrides(args, cpu=args.cpu, memory=memory, gpu=args.gpu), "image": _build_image(cfg)})
    backend = backends.get(cfg.backend)
    env = dict(os.environ)
    env.pop("ROVING_CHILD", None)
    env["ROVING_BACKEND"] = cfg.backend
    if args.dashboard:
        env["ROVING_DASHBOARD"] = "1"
    if cfg.image:
        env["ROVING_IMAGE"] = cfg.image
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    spec = backends.JobSpec(
        name=os.path.basename(args.script), command=[sys.executable, args.script, *args.args], env=env,
        cwd=os.getcwd(), session=session.current().job_session(),
        resources=backends.Resources(cfg.cpu, config.parse_memory(cfg.memory) if cfg.memory else None, cfg.gpu),
        output="prefix")
    job = backend.create_job(spec)
    print(f"roving: {args.script} runs as {cfg.backend} job {job.id}", file=sys.stderr)
    try:
        code = backend.wait(job)
    except KeyboardInterrupt:
        backend.terminate_job(job)
        code = backend.wait(job, 30)
    time.sleep(0.3)  # the last lines of output
    if code is None:
        return 1
    return code if code >= 0 else 128 - code


def _overrides(args: argparse.Namespace, **extra: Any) -> dict:
    options = {k: v for k, v in extra.items() if v is not None}
    if getattr(args, "backend", None):
        options["backend"] = args.backend
    return options


def _ps(args: argparse.Namespace) -> int:
    from . import backends

    cfg = _configure(args)
    jobs = backends.get(cfg.backend).list_jobs()
    print(f"{'JOB':<20} {'SESSION':<13} {'NAME':<24} {'STATE':<11} REASON")
    for j in jobs:  # every field is the cluster's, and a label or a job's name is anyone's to choose
        print(f"{_shown(j.id):<20} {_shown(j.session):<13} {_shown(j.name):<24} {_shown(j.state):<11} "
              f"{_shown(j.reason)}")
    return 0


def _logs(args: argparse.Namespace) -> int:
    from . import backends

    if args.failed == bool(args.job):
        print("roving: error: give a job id or --failed (not both)", file=sys.stderr)
        return 2
    if args.failed:
        return _logs_failed()
    cfg = _configure(args)
    backend = backends.get(cfg.backend)
    sys.stdout.write(_shown(backend.logs(backend.job(args.job)), keep="\n\t"))
    return 0


def _logs_failed() -> int:
    from . import crashlog

    try:
        found = crashlog.records()
    except crashlog.CrashLogError as exc:
        print(f"roving: error: {exc}", file=sys.stderr)
        return 1
    if not found:
        print(f"no crashed children on record (in {crashlog.folder()})")
        return 0
    for rec in found:
        print(_shown(rec.header()))
        for line in rec.lines:
            print(f"  {_shown(line, keep=chr(9))}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from . import backends

    cfg = _configure(args)
    backend = backends.get(cfg.backend)
    if args.all == bool(args.jobs):
        print("roving: error: give job ids or --all (not both)", file=sys.stderr)
        return 2
    # --all: only this user's jobs (another user's are not ours to stop, even where we could)
    ids = [j.id for j in backend.list_jobs(user=backends.user_name())] if args.all else args.jobs
    unknown = [] if args.all else backend.unknown_ids(ids)
    if unknown:
        # nothing is cancelled when an id is wrong: a typo must not leave half of a list cancelled
        print(f"roving: error: unknown job: no roving job {_shown(', '.join(unknown))} among those `roving ps` lists "
              f"on the {cfg.backend} backend; nothing was cancelled", file=sys.stderr)
        return 1
    backend.cancel_ids(ids)
    for job_id in ids:
        print(f"cancelled {_shown(job_id)}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from . import backends

    cfg = _configure(args)
    print(f"backend: {cfg.backend} ({_chosen_why(cfg) if not args.backend else 'given with --backend'})")
    for key, value in backends.get(cfg.backend).describe().items():
        print(f"  {key}: {_shown(value)}")
    from .transport import session

    try:
        choice = session.current().address()
    except OSError as exc:
        print(f"address: none could be chosen: {exc}")
        return 1
    ports = f"{choice.port_range[0]}-{choice.port_range[1]}" if choice.port_range else "any free port"
    print(f"address: binds {choice.bind}, advertises {choice.advertise} ({choice.why}); ports: {ports}")
    if args.workers < 0:
        print(f"roving info: --workers must be at least 0, not {args.workers}", file=sys.stderr)
        return 2
    return _info_workers(args.workers, cfg) if args.workers else 0


def _info_workers(n: int, cfg: Config) -> int:
    """Start ``n`` workers that do nothing but check their environment; print what each said."""
    from . import environment
    from .process import Process, ProcessStartError

    here = environment.here()
    print(_shown(f"this machine: Python {here.python} ({here.implementation}, {here.platform}); "
                 + ", ".join(f"{k} {v}" for k, v in here.packages.items())))
    procs = [Process(target=environment.probe, name=f"info-worker-{i + 1}") for i in range(n)]
    for p in procs:
        p.start()
    worst = 0
    for p in procs:
        try:
            p.join(cfg.connect_timeout + 60)
        except environment.EnvironmentMismatchError:
            worst = 1
        except ProcessStartError as exc:
            print(_shown(f"  {p.name}: did not start: {exc}"))
            worst = 1
            continue
        if p.exitcode is None:
            p.kill()
            print(f"  {p.name}: did not end within {cfg.connect_timeout + 60:g} s; killed")
            worst = 1
            continue
        report = p.environment
        if report is None:
            print(f"  {p.name}: exited with code {p.exitcode} before it said anything of its environment")
            worst = 1
            continue
        # what a worker reports is its own word: shown, never obeyed by the terminal
        f = report.fingerprint
        print(_shown(f"  {p.name} on {report.host}: Python {f.python} ({f.implementation}, {f.platform})"))
        if not report.differences:
            print(_shown(f"    same as this machine (env_check={report.policy})"))
        for d in report.differences:
            print(_shown(f"    differs: {d} ({'an error' if d.fatal else 'a warning'} under "
                         f"env_check={report.policy})"))
    return worst


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
