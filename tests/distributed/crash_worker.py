"""Worker of tests/distributed/test_shared_launch.py: rank 1 crashes in native code (``os.abort``), raises a Python
error, or finishes, by ``--mode`` and by how many launches ``--marker`` has counted; the other ranks finish.
``--mode hang``: every rank writes its pid into ``--marker``'s folder and sleeps until it is killed."""

import argparse
import os
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker", required=True)
    parser.add_argument("--mode", choices=["abort_first_launch", "abort_every_launch", "raise", "hang"], required=True)
    args = parser.parse_args(argv)
    if args.mode == "hang":
        Path(args.marker).parent.joinpath(f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
        time.sleep(3600)
    if int(os.environ["RANK"]) != 1:
        return
    marker = Path(args.marker)
    launches = int(marker.read_text()) + 1 if marker.exists() else 1
    marker.write_text(str(launches))
    if args.mode == "raise":
        raise RuntimeError("the worker's own error")
    if args.mode == "abort_every_launch" or launches == 1:
        os.abort()


if __name__ == "__main__":
    main()
