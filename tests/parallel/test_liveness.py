"""The heartbeat (hf_bdlm.parallel.liveness) in a process of its own: it beats, and it is over before the process ends.

A finished 2-process training run once exited -6 at teardown ("terminate called without an active exception"); a
daemon thread still inside a store client when the interpreter finalizes is one way to get there (not shown to be
that run's), so the heartbeat stops and joins its thread at exit. The killed-rank diagnosis itself is tested under
real launches in tests/trainer/test_faults.py.
Run: python -m pytest tests/parallel/test_liveness.py -q
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import atexit, socket, time
    import torch.distributed as dist
    from hf_bdlm.parallel import liveness

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    beats = []
    # Registered before the heartbeat's own handler, so it runs after it (atexit is last in, first out).
    atexit.register(lambda: print("beating at exit:", beats[0].beating, flush=True))
    beats.append(liveness.Heartbeat(0, 2, "127.0.0.1", port))
    time.sleep(3 * liveness.BEAT_S)
    print("counter:", master.add("hf_bdlm/heartbeat/0", 0), flush=True)
""")


def test_the_heartbeat_beats_and_has_stopped_when_the_process_ends():
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    lines = dict(line.split(": ") for line in done.stdout.splitlines())
    assert int(lines["counter"]) >= 2  # about one beat per second for 3 s
    assert lines["beating at exit"] == "False"
