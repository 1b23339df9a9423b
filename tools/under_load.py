"""Run a command while ``N`` busy processes spin (an artificial load), then end them, whatever the command did.

    python3 tools/under_load.py 8 make test      # make test-under-load

The busy processes are plain shell loops (their ids in ``UNDER_LOAD_PIDS`` for the command); they are ended by
their process ids (never by name) when the command ends, fails or is interrupted. Prints the load average before and after and the command's wall time; exits with
the command's status. Standard library only.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

SPIN = ["sh", "-c", "while :; do :; done"]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: under_load.py N COMMAND [ARGS...]")
    count, command = int(argv[0]), argv[1:]
    print(f"under_load: {count} busy processes on {os.cpu_count()} cores; load average before: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    spinners = []
    started = time.monotonic()  # reported, never compared with a limit
    try:
        spinners = [subprocess.Popen(SPIN, stdin=subprocess.DEVNULL) for _ in range(count)]
        env = {**os.environ, "UNDER_LOAD_PIDS": " ".join(str(p.pid) for p in spinners)}
        code = subprocess.call(command, env=env)
    except KeyboardInterrupt:
        code = 130
    finally:
        for proc in spinners:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"under_load: {' '.join(command)} exited {code} after {time.monotonic() - started:.0f} s; load average "
          f"after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; the {count} busy processes are ended", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
