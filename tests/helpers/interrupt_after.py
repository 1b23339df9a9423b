"""`capeval` with a real SIGINT sent to itself after its N-th scored batch (N from CAPEVAL_TEST_STOP_AFTER;
CAPEVAL_TEST_SIGINTS=2 sends a second one right after, as a user pressing Ctrl-C twice), and a count of the
batches it scored printed to stderr: how the tests interrupt a run part-way."""
import os
import signal
import sys

from capeval_plugins.session import loop
from capeval_plugins.cli import main

stop_after = int(os.environ.get("CAPEVAL_TEST_STOP_AFTER", "0"))
sigints = int(os.environ.get("CAPEVAL_TEST_SIGINTS", "1"))
original = loop._score_batch
scored = 0


def score_batch(*args, **kwargs):
    global scored
    original(*args, **kwargs)
    scored += 1
    if scored == stop_after:
        for _ in range(sigints):
            os.kill(os.getpid(), signal.SIGINT)


loop._score_batch = score_batch
code = main(sys.argv[1:])
print(f"batches mapped by this process: {scored}", file=sys.stderr)
sys.exit(code)
