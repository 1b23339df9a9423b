"""The Java tools' children die with capeval: killed by the kernel when the process that started them ends, however
it ends (``kill -9`` included), and not before, even when the thread that asked for them has ended (issue 49).

The checks poll for the outcome with a generous bound: what they prove is the mechanism (the child is gone because
its parent went, not because it finished), never a time limit."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import PYTHON, has_java

from capeval_plugins.resources import java

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's (prctl)")
GENEROUS = 60.0  # seconds: a loaded machine may take a while to schedule the kernel's kill and the reaping


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for a parent that does not reap it counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_until(condition, bound: float = GENEROUS) -> bool:
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


# A process that starts a child through the Java tools' process class, says the child's pid, then waits (the
# child, `sleep`, reads no input: end of input would never end it, only its parent's death can).
HOLDER = """
import sys, time
from capeval_plugins.resources import java
child = java.JavaProcess(["sleep", "600"], ".", "a child")
print(child.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_child_is_killed_by_the_kernel_when_its_parent_is_killed_with_sigkill():
    holder = subprocess.Popen([PYTHON, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(holder.stdout.readline())
        assert not gone(pid)
        holder.kill()  # SIGKILL: no atexit, no finally, nothing of the holder's runs
        holder.wait()
        assert wait_until(lambda: gone(pid)), f"child {pid} outlived its parent killed with SIGKILL"
    finally:
        holder.kill()
        holder.wait()
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_child_started_from_a_thread_that_ends_lives_on_until_the_process_ends():
    """The kernel's death signal follows the parent *thread*: a JVM asked for by a worker thread (a thread pool's)
    must not be killed when that thread ends while the process still uses it."""
    started: list[java.JavaProcess] = []
    native: list[int] = []

    def worker() -> None:
        native.append(threading.get_native_id())
        started.append(java.JavaProcess(["sleep", "600"], ".", "a child"))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    child = started[0]
    try:
        # the worker's kernel thread is gone (not only its Python object): its death signal, if any, was sent
        assert wait_until(lambda: not Path(f"/proc/self/task/{native[0]}").exists())
        assert child.alive()
    finally:
        child.kill()


def test_a_child_that_cannot_start_raises_in_the_callers_thread():
    with pytest.raises(java.ExternalToolError, match="cannot start"):
        java.JavaProcess(["/nonexistent/java-binary"], ".", "a child")


@pytest.mark.skipif(not has_java(), reason="METEOR needs Java")
def test_meteors_jvm_is_gone_after_capeval_is_killed_with_sigkill(tmp_path):
    """`capeval score -m meteor` killed with SIGKILL while its METEOR JVM loads its paraphrase table: the JVM goes
    too (it used to stay until it had read its table and the end of its input)."""
    captions = tmp_path / "captions.jsonl"
    rows = [(f"a dog number {i} runs on the grass", ["a dog running on grass", "a brown dog plays"]) for i in range(50)]
    captions.write_text("".join(json.dumps({"caption": c, "references": r}) + "\n" for c, r in rows))
    env = {**os.environ, "CAPEVAL_CACHE": str(tmp_path / "cache")}
    command = [PYTHON, "-m", "capeval_plugins.cli", "score", "-m", "meteor", "-o", "meteor.paraphrases=full",
               "--captions", str(captions), "--out", str(tmp_path / "scores.jsonl"), "--quiet"]
    capeval = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    jvm = None
    try:
        def meteor_started() -> bool:
            nonlocal jvm
            for pid in children(capeval.pid):
                try:
                    if b"meteor" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        jvm = pid
                        return True
                except OSError:
                    continue
            return capeval.poll() is not None

        assert wait_until(meteor_started, 600) and jvm is not None, "capeval ended before starting METEOR's JVM"
        capeval.kill()
        capeval.wait()
        assert wait_until(lambda: gone(jvm)), f"METEOR's JVM {jvm} outlived capeval killed with SIGKILL"
    finally:
        capeval.kill()
        capeval.wait()
        if jvm is not None and not gone(jvm):
            os.kill(jvm, signal.SIGKILL)


def test_a_java_wrapper_whose_child_hangs_ends_in_the_timeouts_one_line(tmp_path, monkeypatch):
    """A `java` that is a shell script starting the JVM: killing the script on timeout left its child holding the
    output pipes, and closing them waited on the reader thread for as long as that child lived (here: for ever)."""
    from conftest import HANG_GUARD

    from capeval_plugins.core.messages import ExternalToolError
    from capeval_plugins.metrics import coco

    fake = tmp_path / "bin"
    fake.mkdir()
    marker = tmp_path / "child.pid"
    (fake / "java").write_text(f"#!/bin/sh\nsleep 100000 &\necho $! > {marker}\nwait\n")
    (fake / "java").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CAPEVAL_JAVA_TIMEOUT", "2")
    coco.forget_prepared()
    raised: list[BaseException] = []

    def tokenise() -> None:
        try:
            coco.ptb_texts(["a dog runs", "a cat"])
        except BaseException as err:  # noqa: BLE001  (handed to the test's thread)
            raised.append(err)

    worker = threading.Thread(target=tokenise, daemon=True)
    try:
        worker.start()
        worker.join(timeout=HANG_GUARD)
        assert not worker.is_alive(), "still waiting on the wrapper's child"
        assert len(raised) == 1 and isinstance(raised[0], ExternalToolError), raised
        assert "the PTB tokenizer" in str(raised[0])
    finally:
        if marker.exists():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(marker.read_text()), signal.SIGKILL)
