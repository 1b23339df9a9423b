"""Java tools (pycocoevalcap's PTB tokenizer and METEOR 1.5) as child processes that cannot hang the caller.

Every wait on a child is bounded: a reader thread turns its stdout into a queue of lines, so a read has a
deadline and sees the child's death (end of its output) at once; a writer thread feeds its stdin, so a large
request never deadlocks against a full pipe; its stderr is kept (the last 64 KiB, for the error message) and
shown unless ``CAPEVAL_QUIET=1``. A child that dies, stops answering for :func:`timeout` seconds or answers
out of protocol is killed and raises :class:`~capeval_plugins.core.messages.ExternalToolError`, which the
command line reports in one line (exit code 2). No child outlives the process (:func:`spawn`): on Linux the kernel
kills it when capeval ends, ``kill -9`` included.

METEOR runs as one long-lived JVM per process (loading its paraphrase tables costs seconds of CPU), shared by
every call; requests are streamed (every ``SCORE`` line written at once, the answers read as they come, not
one round trip per segment), identical segments are scored once, and ``jvms > 1`` spreads the segments over
several JVMs before the single ``EVAL`` over every segment's statistics, so the corpus score stays the jar's
own aggregate.
"""
from __future__ import annotations

import atexit
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from capeval_plugins.core.messages import ExternalToolError

QUIET_ENV = "CAPEVAL_QUIET"          # set by `capeval ... --quiet`: the Java tools' own lines are not shown
TIMEOUT_ENV = "CAPEVAL_JAVA_TIMEOUT"  # seconds a Java tool may go without answering (default below)
DEFAULT_TIMEOUT = 120.0
MAX_TIMEOUT = 86400.0
STARTUP_TIMEOUT = 600.0              # METEOR's first answer waits for its paraphrase tables (seconds of CPU)
STDERR_KEPT = 64 * 1024

# The JVMs' flags: the serial collector and the client compiler spend about a third less CPU than the JVM's
# defaults on a captioning corpus (METEOR; the PTB tokenizer's 0.2 CPU-s on 500 rows, 0.14) (benchmarks/README.md);
# flags an exotic JVM does not know are ignored. Outputs are the jars': Java's floating point and a lexer's tokens
# do not depend on the compiler.
JVM_FLAGS = ("-XX:+IgnoreUnrecognizedVMOptions", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
# A JVM whose live data is small (the PTB tokenizer; METEOR with a corpus's cut of its table) reuses a 16 MB young
# generation instead of touching fresh pages of the default one (a 64th of the machine's memory): 0.1 CPU-s less
# on 500 rows. Not with METEOR's full table, whose 1.5 GB of objects a small young generation would copy often.
SMALL_YOUNG = "-Xmn16m"
METEOR_JVM_FLAGS = (*JVM_FLAGS, "-Duser.language=en", "-Duser.country=US")  # it parses numbers with the locale's
                                                                             # Scanner
METEOR_HEAP = "-Xmx2G"                                   # pycocoevalcap's own command line
METEOR_ARGS = ("-", "-", "-stdio", "-l", "en", "-norm")
PTB_CLASS = "edu.stanford.nlp.process.PTBTokenizer"


def timeout() -> float:
    """Seconds a Java tool may go without a line of output before it is given up (``CAPEVAL_JAVA_TIMEOUT``)."""
    value = os.environ.get(TIMEOUT_ENV)
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT:  # NaN, infinities, 0 and negatives too: a wait that never ends or never starts
        raise ExternalToolError(f"{TIMEOUT_ENV} must be a number of seconds above 0 and at most {MAX_TIMEOUT:g} (a "
                                f"day), got {value!r}")
    return seconds


def require_java(what: str, hint: str = "") -> None:
    if shutil.which("java") is None:
        raise ExternalToolError(f"{what} needs a Java runtime (pycocoevalcap runs jars): install Java 8 or later "
                                f"and put `java` on PATH{hint}")


class JavaProcess:
    """A child that reads lines on stdin and answers lines on stdout, with bounded waits (see the module)."""

    def __init__(self, command: Sequence[str], cwd: str, name: str) -> None:
        self.name = name
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.stderr: deque[bytes] = deque()
        self._stderr_size = 0
        self._echo = os.environ.get(QUIET_ENV) != "1"
        try:
            self.proc = spawn(list(command), cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
        except OSError as err:
            raise ExternalToolError(f"{name}: cannot start {command[0]!r}: {err}") from err
        self._threads = [threading.Thread(target=self._read_stdout, daemon=True, name=f"{name} stdout"),
                         threading.Thread(target=self._read_stderr, daemon=True, name=f"{name} stderr")]
        for thread in self._threads:
            thread.start()

    def _read_stdout(self) -> None:
        try:
            for line in self.proc.stdout:
                self.lines.put(line)
        except (OSError, ValueError):  # closed under us by close()
            pass
        self.lines.put(None)

    def _read_stderr(self) -> None:
        try:
            while chunk := self.proc.stderr.read1(8192):
                self.stderr.append(chunk)
                self._stderr_size += len(chunk)
                while self._stderr_size > STDERR_KEPT and len(self.stderr) > 1:
                    self._stderr_size -= len(self.stderr.popleft())
                if self._echo:
                    _echo(chunk)
        except (OSError, ValueError):
            pass

    def send(self, text: str, close: bool = False) -> None:
        """Write ``text`` (UTF-8) to the child from a writer thread; ``close``: then close its stdin."""

        def write() -> None:
            try:
                self.proc.stdin.write(text.encode("utf-8"))
                self.proc.stdin.flush()
                if close:
                    self.proc.stdin.close()
            except (OSError, ValueError):  # the child died or was stopped: its reader sees the output end
                pass

        threading.Thread(target=write, daemon=True, name=f"{self.name} stdin").start()

    def read_line(self, wait: float) -> str:
        """The next line of output; at most ``wait`` seconds, and at once if the child has ended."""
        try:
            line = self.lines.get(timeout=wait)
        except queue.Empty:
            raise self.failure(f"gave no answer for {wait:.0f} s (set {TIMEOUT_ENV} to wait longer)") from None
        if line is None:
            raise self.failure("ended before answering")
        return line.decode("utf-8", errors="replace").rstrip("\r\n")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def failure(self, what: str) -> ExternalToolError:
        """Kill the child and describe what happened, with what it said on stderr."""
        self.kill()
        code = self.proc.returncode
        for thread in self._threads:
            thread.join(timeout=2)
        said = b"".join(self.stderr).decode("utf-8", errors="replace").strip()
        exit_note = f" (exit status {code})" if code not in (None, -9) else ""
        message = f"{self.name} {what}{exit_note}"
        error = ExternalToolError(message + ("; it said:\n" + said[-4000:] if said else ""))
        error.cli_message = message + (f": {_telling_line(said)}" if said else "")  # one line for the command line
        return error

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process the kernel will not reap
            pass

    def close(self, wait: float = 10.0) -> None:
        """End the child: close its stdin (Java tools exit at end of input), kill it if it lingers."""
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.kill()
        for thread in self._threads:
            thread.join(timeout=2)
        for thread, pipe in zip(self._threads, (self.proc.stdout, self.proc.stderr)):
            if thread.is_alive():  # a child of the child (a `java` that is a wrapper script) still holds its end:
                continue           # closing would wait on the reader forever; it ends with that process
            try:
                pipe.close()
            except (OSError, ValueError):
                pass


# ---------------------------------------------------------------------------------------------- children die with us

# A child must not outlive this process: a JVM left behind by ``kill -9`` of capeval keeps its heap and CPU until
# it notices (METEOR's ends at end of input, but not while it loads its tables or works through queued requests,
# and never while a forked process still holds its stdin open). On Linux each child is started with
# PR_SET_PDEATHSIG = SIGKILL, so the kernel kills it when its parent goes. The kernel means the parent *thread*:
# children are therefore started by one daemon thread that lives as long as the process (:func:`spawn`), never by
# the caller's thread, which may end (a worker of a thread pool) while the JVM it started is still in use.
PR_SET_PDEATHSIG = 1


def _death_signal_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks the kernel to SIGKILL the child when its parent thread ends (Linux), or None
    where the platform has no such request. libc's ``prctl`` is looked up here, before any fork: between fork
    and exec the child may only call it (and ``getppid``), never import or allocate."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    kill, getppid, exit_now = signal.SIGKILL, os.getppid, os._exit

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if getppid() != parent:  # the parent died before the request was made: end now, as the kernel would have
            exit_now(1)

    return hook


class _Spawner:
    """The one thread that starts this process's children (see above); restarted in a forked child process."""

    def __init__(self) -> None:
        self.pid = -1
        self.requests: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.hook: Callable[[], None] | None = None

    def start(self, command: list[str], **popen) -> subprocess.Popen:
        with self.lock:
            if self.pid != os.getpid():  # first use, or a fork's child (which has no such thread)
                self.pid, self.requests, self.hook = os.getpid(), queue.Queue(), _death_signal_hook()
                threading.Thread(target=self._serve, args=(self.requests,), daemon=True,
                                 name="capeval child starter").start()
        if self.hook is None:
            return subprocess.Popen(command, **popen)
        done: queue.Queue = queue.Queue(maxsize=1)
        self.requests.put((command, popen, done))
        try:
            ok, value = done.get()
        except BaseException:  # interrupted while it starts: the child, once started, is not left behind
            threading.Thread(target=_kill_when_started, args=(done,), daemon=True).start()
            raise
        if not ok:
            raise value
        return value

    def _serve(self, requests: queue.Queue) -> None:
        while True:
            command, popen, done = requests.get()
            try:
                done.put((True, subprocess.Popen(command, preexec_fn=self.hook, **popen)))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread, raised there
                done.put((False, err))


def _kill_when_started(done: queue.Queue) -> None:
    ok, value = done.get()
    if ok:
        value.kill()
        value.wait()


_SPAWNER = _Spawner()


def spawn(command: Sequence[str], **popen) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen)`` for a child that dies with this process (Linux: killed by the
    kernel when the process ends, however it ends, ``kill -9`` included; elsewhere it ends at end of its
    input as before)."""
    return _SPAWNER.start(list(command), **popen)


def _echo(chunk: bytes) -> None:
    """A child's stderr passed on to ours (where the user sees the tools' own progress lines)."""
    try:
        if hasattr(sys.stderr, "buffer"):
            sys.stderr.buffer.write(chunk)
        else:
            sys.stderr.write(chunk.decode(errors="replace"))
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _telling_line(said: str) -> str:
    """The line of a tool's stderr that says most: the first naming an exception or error, else the last."""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    for line in lines:
        if "Exception" in line or "Error" in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


# ---------------------------------------------------------------------------------------------- PTB

# Characters the PTB tokenizer (-preserveLines) reads as a line break: inside a caption they would shift every
# later caption onto the wrong row (pycocoevalcap replaces only "\n"). As spaces they separate tokens, as
# whitespace does; every other character reaches the tokenizer as written.
PTB_LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\u2028\u2029\x0b\x0c"})


def ptb_files(texts: Sequence[str], jar: str) -> list[list[str]]:
    """Stanford PTBTokenizer (``-preserveLines -lowerCase``, the jar and options pycocoevalcap uses) over each
    text as a file of its own, in one JVM (``-ioFileList``): each file ends where its text ends, as
    pycocoevalcap's temporary file does, which the lexer reads differently from a line end (a final ``:)`` is
    split, a period before a last "The" kept). The output lines of each file; a last line without tokens gets
    none (the caller knows how many it sent). The files live in a private temporary folder, removed after."""
    from capeval_plugins import files

    if not texts:
        return []
    require_java("PTB tokenisation", ", or pass tokenize=False for text that is already tokenised")
    folder = files.private_folder("capeval-ptb-")
    try:
        with files.Folder.open(folder)[0] as out:
            for k, text in enumerate(texts):
                out.write(f"in{k}.txt", text.encode("utf-8"))
            # relative names, read from the folder (a temporary folder's path may hold spaces)
            out.write("files.txt", "".join(f"in{k}.txt out{k}.txt\n" for k in range(len(texts))).encode())
        command = ptb_command(jar)
        command[command.index("-cp") + 1] = os.path.abspath(jar)  # (run from the folder, not beside the jar)
        child = JavaProcess([*command, "-ioFileList", "files.txt"], str(folder), "the PTB tokenizer (Java)")
        try:
            child.send("", close=True)
            wait = timeout() + sum(map(len, texts)) / 1e5
            try:
                code = child.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                raise child.failure(f"did not finish within {wait:.0f} s (set {TIMEOUT_ENV} to wait longer)") from None
            if code != 0:
                raise child.failure("failed")  # (the failure names the exit status)
        except BaseException:
            child.kill()
            raise
        finally:
            child.close()
        made = []
        for k in range(len(texts)):
            data = files.read_input(folder / f"out{k}.txt", "the PTB tokenizer's output")
            made.append(data.decode("utf-8", errors="replace").split("\n"))
        return made
    finally:
        files.remove_private(folder)


def ptb_command(jar: str) -> list[str]:
    return ["java", *JVM_FLAGS, SMALL_YOUNG, "-cp", os.path.basename(jar), PTB_CLASS, "-preserveLines", "-lowerCase"]


# ---------------------------------------------------------------------------------------------- METEOR

# METEOR's stdio protocol splits a line at every "|||" and ends it at "\n" or "\r" (Java's readLine). Runs of
# three or more pipes are spaced out ("| | |"): METEOR's normaliser (-norm) makes every pipe a token of its
# own, so the jar reads the same words it would read in the text itself (pycocoevalcap deletes "|||" from
# the candidate and lets it split a reference in two).
_PIPES = re.compile(r"\|{3,}")
_LINE_ENDS = str.maketrans({"\n": " ", "\r": " "})


def meteor_text(text: str) -> str:
    """A caption as one field of a METEOR request."""
    text = text.translate(_LINE_ENDS)
    return _PIPES.sub(lambda m: " ".join(m.group()), text) if "|||" in text else text


def score_line(hypothesis: str, references: Sequence[str]) -> str:
    """pycocoevalcap's ``SCORE`` request (its double-space fix of the hypothesis included), fields escaped."""
    hypothesis = meteor_text(hypothesis).replace("  ", " ")
    return " ||| ".join(("SCORE", " ||| ".join(meteor_text(r) for r in references), hypothesis))


class MeteorJVM:
    """One METEOR 1.5 JVM (``java -jar meteor-1.5.jar - - -stdio -l en -norm``, ``-a table``: another
    paraphrase table than the jar's own)."""

    def __init__(self, jar: str, table: str | None = None) -> None:
        require_java("METEOR")
        command = meteor_command(jar, table) if table else meteor_command(jar)
        self.child = JavaProcess(command, os.path.dirname(os.path.abspath(jar)), "METEOR (Java)")
        self.ready = False  # until its first answer: the paraphrase tables are loaded

    def _wait(self) -> float:
        return timeout() if self.ready else max(STARTUP_TIMEOUT, timeout())

    def stats(self, lines: Sequence[str]) -> list[str]:
        """The segment statistics of ``SCORE`` lines, streamed: all written at once, answers read as they come."""
        if not lines:
            return []
        self.child.send("".join(line + "\n" for line in lines))
        out: list[str] = []
        try:
            for _ in lines:
                answer = self.child.read_line(self._wait())
                self.ready = True
                if not _is_stats(answer):
                    raise self.child.failure(f"answered {answer[:200]!r} to a SCORE request")
                out.append(answer)
        except ExternalToolError as err:
            err.pending = len(out)  # the request it failed on (the first unanswered one)
            raise
        return out

    def evaluate(self, stats: Sequence[str]) -> tuple[float, list[float]]:
        """``EVAL`` over every segment's statistics: the jar's per-segment scores and its corpus score."""
        self.child.send("EVAL ||| " + " ||| ".join(stats) + "\n")
        values = []
        for _ in range(len(stats) + 1):
            answer = self.child.read_line(self._wait())
            try:
                values.append(float(answer.strip()))
            except ValueError:
                raise self.child.failure(f"answered {answer[:200]!r} to EVAL") from None
        return values[-1], values[:-1]

    def alive(self) -> bool:
        return self.child.alive()

    def close(self) -> None:
        self.child.close()


def meteor_command(jar: str, table: str | None = None) -> list[str]:
    return ["java", *METEOR_JVM_FLAGS, *((SMALL_YOUNG,) if table else ()), METEOR_HEAP, "-jar", os.path.basename(jar),
            *METEOR_ARGS, *(("-a", table) if table else ())]


def _summed_stats(stats: Sequence[str], order: Sequence[int]) -> str | None:
    """Every row's statistics added up as METEOR adds them, as one statistics line (None when they are not
    whole numbers, or not in the layout below).

    ``EVAL`` parses each line of statistics (slowly: about 0.14 ms each) and adds them up with
    ``MeteorStats.addStats``: field by field, except that the chunks of a segment matched perfectly in one
    chunk are left out; ``computeMetrics`` then scores the sum (its weighted fields are recomputed from it).
    Whole numbers add up exactly in any order, so the sum computed here, each distinct segment counted as
    often as it occurs, is the jar's own: ``EVAL`` of that one line gives its corpus score, bit for bit
    (tests compare it with the jar's ``EVAL`` over every row). Layout (1.5): test and reference length, test
    and reference function words, then per matching stage test and reference content and function matches,
    then chunks and test and reference word matches."""
    counts: dict[int, int] = {}
    for k in order:
        counts[k] = counts.get(k, 0) + 1
    total: list[int] = []
    for k, n in counts.items():
        values = [float(x) for x in stats[k].split()]
        if (len(values) - 7) % 4 or len(values) < 11 or not all(v.is_integer() and abs(v) < 2 ** 40 for v in values):
            return None
        fields = [int(v) for v in values]
        if not total:
            total = [0] * len(fields)
        elif len(fields) != len(total):
            return None
        chunks = len(fields) - 3
        matched_test = sum(fields[4:chunks:4]) + sum(fields[6:chunks:4])
        matched_ref = sum(fields[5:chunks:4]) + sum(fields[7:chunks:4])
        perfect = matched_test == fields[0] and matched_ref == fields[1] and fields[chunks] == 1
        for i, v in enumerate(fields):
            if i != chunks or not perfect:
                total[i] += v * n
    return " ".join(f"{v}.0" for v in total)


def _is_stats(line: str) -> bool:
    fields = line.split()
    if not fields:
        return False
    try:
        [float(x) for x in fields]
    except ValueError:
        return False
    return True


def max_jvms() -> int:
    """The METEOR JVMs one scoring runs at most: one per CPU this process may use (they are CPU-bound, and more
    would only share the CPUs while each holds its own heap)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - no affinity on this platform
        return max(1, os.cpu_count() or 1)


def bounded_jvms(jvms: int) -> int:
    """``jvms`` within 1 .. :func:`max_jvms` (the scores do not depend on it), saying so once when cut."""
    most = max_jvms()
    if int(jvms) > most:
        from capeval_plugins.core.messages import warn_once

        warn_once(("meteor-jvms", int(jvms), most), f"meteor: jvms={int(jvms)} asks for more JVMs than the {most} "
                  f"CPU(s) this process may use; running at most {most} (the scores are the same)")
    return max(1, min(int(jvms), most))


PARAPHRASES = ("corpus", "full")  # METEOR's paraphrase table: the entries the corpus can use (the same scores), or all
MAX_CORPUS_TABLES = 8  # JVMs started on a corpus's table in one process before one loads the full table for good


class MeteorPool:
    """The process's METEOR JVMs, started on first use and kept until exit; one scoring at a time.

    Their paraphrase table (:mod:`capeval_plugins.resources.meteor_table`) is, by default, the entries the first
    corpus can use (the same scores; loading it costs the JVM half a second instead of 6-7 s). JVMs are kept
    while their table serves the next corpus: the full table always does, a corpus's table does when it holds
    every entry the next corpus can use. When it does not, the next JVMs load every entry with a phrase among
    the references seen so far (a match needs one phrase in a reference): that table serves those references
    with any candidates, so a validation loop scoring new captions of the same images every epoch starts one
    more JVM, on its second epoch, and keeps it. After :data:`MAX_CORPUS_TABLES` starts in one process (about
    the CPU of one full load) the next JVM loads the full table and serves everything after."""

    def __init__(self) -> None:
        self.jvms: list[MeteorJVM] = []
        self.table = None  # the FilteredTable the running JVMs loaded; None: the jar's own, full table
        self.corpus_tables = 0  # JVM starts on a corpus's table in this process
        self.used = ""  # "corpus" or "full": the table of the last scoring, and why the full one
        self.full_reason = ""
        self.lock = threading.Lock()
        self._registered = False

    def score(self, jar: str, segments: Sequence[tuple[str, Sequence[str]]], rows: Sequence[int] | None = None,
              jvms: int = 1, paraphrases: str = "corpus") -> tuple[float, list[float]]:
        """METEOR of ``segments`` (hypothesis, references): the corpus score (the jar's aggregate over every
        row) and one score per row. ``rows[i]`` is the segment of row ``i`` (default: one row per segment),
        so a segment repeated in many rows is scored once and counted as often as it occurs.
        ``paraphrases``: ``"corpus"`` (the table cut down to the corpus) or ``"full"``; the same scores."""
        jvms = bounded_jvms(jvms)
        return self._locked(paraphrases, lambda: self._score(jar, segments, rows, jvms, paraphrases))

    def statistics(self, jar: str, segments: Sequence[tuple[str, Sequence[str]]],
                   paraphrases: str = "corpus") -> list[str]:
        """The jar's statistics line of each segment (hypothesis, references): its answer to a ``SCORE`` request,
        what pycocoevalcap's ``Meteor._stat`` returns."""
        return self._locked(paraphrases, lambda: self._statistics(jar, segments, paraphrases))

    def _locked(self, paraphrases: str, work: Callable):
        """``work()``, alone in the process's pool; the JVMs it used are not reused when it fails."""
        if paraphrases not in PARAPHRASES:
            raise ValueError(f"paraphrases must be one of {PARAPHRASES}, got {paraphrases!r}")
        if not self.lock.acquire(timeout=max(STARTUP_TIMEOUT, timeout())):
            raise ExternalToolError("METEOR: another scoring in this process did not finish")
        try:
            return work()
        except BaseException:
            self.stop(kill=True)  # a JVM that failed or was interrupted mid-protocol is not reused
            raise
        finally:
            self.lock.release()

    def _statistics(self, jar: str, segments, paraphrases: str) -> list[str]:
        lines = [score_line(h, refs) for h, refs in segments]
        self._choose_table(jar, lines, paraphrases)
        self._start(jar, 1)
        return self.jvms[0].stats(lines)

    def _score(self, jar: str, segments, rows, jvms: int, paraphrases: str) -> tuple[float, list[float]]:
        lines = [score_line(h, refs) for h, refs in segments]
        index: dict[str, int] = {}
        of_segment = [index.setdefault(line, len(index)) for line in lines]
        distinct = list(index)
        self._choose_table(jar, distinct, paraphrases)
        self._start(jar, min(jvms, max(1, len(distinct))))
        active = self.jvms[:min(jvms, max(1, len(distinct)))]
        share = -(-len(distinct) // len(active)) if distinct else 0
        parts = [distinct[k * share:(k + 1) * share] for k in range(len(active))]
        try:
            stats = [s for part in self._stats(active, parts) for s in part]
        except ExternalToolError as err:
            failed = getattr(err, "shard", 0) * share + getattr(err, "pending", 0)
            if failed < len(distinct):  # the first segment of the failed request, to name its sample
                err.segment = of_segment.index(failed)
            raise
        order = of_segment if rows is None else [of_segment[r] for r in rows]
        total = _summed_stats(stats, order)
        if total is None:  # statistics that are not whole numbers: let the jar add them up in row order
            return active[0].evaluate([stats[k] for k in order])
        _, scores = active[0].evaluate(stats)  # each distinct segment once
        corpus, _ = active[0].evaluate([total])
        return corpus, [scores[k] for k in order]

    def _choose_table(self, jar: str, lines: Sequence[str], paraphrases: str) -> None:
        """Keep the running JVMs when their paraphrase table serves ``lines`` (``SCORE`` requests), else stop
        them and set the table the next ones load (see the class)."""
        running = any(jvm.alive() for jvm in self.jvms)
        if paraphrases == "full" and not (running and self.table is None):
            return self._use(None, "asked for")
        if running and self.table is None:  # full_reason: why it was loaded
            self.used = "full"
            return
        from capeval_plugins.resources import meteor_table

        fields = [line.split("|||") for line in lines]  # as the jar splits them: SCORE, references, hypothesis
        corpus = meteor_table.phrases(jar, (f for parts in fields for f in parts[1:-1]), (p[-1] for p in fields))
        if corpus.index is None:
            return self._use(None, corpus.reason)
        if running and self.table.serves(corpus):
            self.used = "corpus"
            return
        if self.corpus_tables >= MAX_CORPUS_TABLES:
            return self._use(None, f"{MAX_CORPUS_TABLES} corpus tables were loaded in this process already")
        prior = self.table if self.table is not None and self.table.source == corpus.index.source else None
        if prior is None and corpus.grams() is not None:
            table = corpus.index.table_for(corpus)
        else:  # a second corpus (a loop, maybe), or hypotheses outside the argument: any hypotheses
            references = corpus.references if prior is None else meteor_table.union(prior.references, corpus.references)
            table = corpus.index.table_for_references(references)
        self._use(table, "")
        self.corpus_tables += 1

    def _use(self, table, reason: str) -> None:
        self.stop()
        self.table, self.used, self.full_reason = table, "full" if table is None else "corpus", reason

    @staticmethod
    def _stats(jvms: list["MeteorJVM"], parts: list[list[str]]) -> list[list[str]]:
        """Each JVM scores its part, all at once; the first failure stops them all and is raised."""
        if len(jvms) == 1:
            return [jvms[0].stats(parts[0])]
        failures: list[ExternalToolError] = []

        def run(k: int) -> list[str]:
            try:
                return jvms[k].stats(parts[k])
            except ExternalToolError as err:
                err.shard = k
                failures.append(err)
                for jvm in jvms:  # the others stop at once too (their readers see their output end)
                    jvm.child.kill()
                raise

        with ThreadPoolExecutor(len(jvms)) as pool:
            futures = [pool.submit(run, k) for k in range(len(jvms))]
        if failures:
            raise failures[0]
        return [f.result() for f in futures]

    def _start(self, jar: str, jvms: int) -> None:
        self.jvms = [jvm for jvm in self.jvms if jvm.alive()]
        while len(self.jvms) < jvms:
            self.jvms.append(MeteorJVM(jar, self.table.path if self.table is not None else None))
        if not self._registered:
            atexit.register(self.stop)
            self._registered = True

    def reset(self) -> None:
        """A fresh process's pool: the JVMs stopped, the corpus tables loaded so far forgotten."""
        with self.lock:
            self.stop()
            self.corpus_tables, self.used, self.full_reason = 0, "", ""

    def stop(self, kill: bool = False) -> None:
        """End every JVM: at end of input (they exit when their queue is done), or at once with ``kill``; then
        remove the paraphrase table written for them."""
        jvms, self.jvms = self.jvms, []
        for jvm in jvms:
            if kill:
                jvm.child.kill()
            jvm.close()
        table, self.table = self.table, None
        if table is not None:
            table.remove()


METEOR = MeteorPool()

