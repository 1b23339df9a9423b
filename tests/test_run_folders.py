"""Run folders, resume and outputs under faults: nothing a user owns is deleted or overwritten, a second run is
refused while one runs, every saved record is checked against its run, inputs are fingerprinted by content,
damaged state is refused in one line, outputs are written whole (issues 23 and 18)."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG_GUARD, PYTHON, StopAfter, cli, write_corpus

import capeval_plugins
from capeval_plugins import runner
from capeval_plugins.caption_files import write_table
from capeval_plugins.checkpoint import LOCK, MANIFEST, RunFolderError, RunStore
from capeval_plugins.inputs import InputError

INTERRUPT = str(Path(__file__).parent / "helpers" / "interrupt_after.py")
N = 40


@pytest.fixture
def files(tmp_path):
    return write_corpus(tmp_path, N)


def corpus_of(files):
    _, folder, rows = files
    return runner.Corpus([r["caption"] for r in rows], [str(folder / r["image"]) for r in rows],
                         [r["references"] for r in rows])


def metrics(model, **options):
    return {"clipscore": capeval_plugins.load("clipscore", model=model, batch_size=4, **options),
            "mid": capeval_plugins.load("mid", model=model, batch_size=8)}


def interrupted_run(model, files, run_dir, after=3, **options):
    with pytest.raises(runner.Interrupted):
        runner.run(metrics(model, **options), corpus_of(files), run_dir=run_dir, stop=StopAfter(after))


def score_cmd(model, files, out, *extra):
    captions, folder, _ = files
    return ["score", "-m", "clipscore", "-m", "mid", "--model", model, "--batch-size", "4", "--captions",
            str(captions), "--images", str(folder), "--out", str(out), "--quiet", *extra]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------
# 1. Nothing the package did not write is deleted


def test_a_folder_holding_the_users_files_is_refused_and_left_as_it_is(tiny_clip, files, tmp_path):
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "thesis.txt").write_text("four years of work")
    (victim / "sub" / "data.csv").write_text("a,b\n1,2\n")
    before = tree(victim)
    for restart in (False, True):
        with pytest.raises(RunFolderError, match="not empty and is not a capeval run folder"):
            runner.score_many(metrics(tiny_clip), *_lists(files), run_dir=victim, restart=restart)
        assert tree(victim) == before


def _lists(files):
    c = corpus_of(files)
    return c.images, c.candidates, c.references


def test_run_dir_dot_is_refused_in_a_working_folder_and_leaves_an_empty_one_empty(tiny_clip, files, tmp_path,
                                                                                    monkeypatch, capsys):
    captions, folder, _ = files
    monkeypatch.chdir(tmp_path)  # holds images/ and captions.jsonl
    before = tree(tmp_path)
    code, _, err = cli(score_cmd(tiny_clip, files, tmp_path / "out.jsonl", "--run-dir", "."), capsys)
    assert code == 2 and err.count("\n") == 1 and "is not a capeval run folder" in err
    assert tree(tmp_path) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    code, _, err = cli(score_cmd(tiny_clip, files, tmp_path / "out.jsonl", "--run-dir", "."), capsys)
    assert code == 0, err
    assert empty.is_dir() and list(empty.iterdir()) == []  # its files gone, the folder the user made stays
    assert tree(folder) and captions.is_file()


def test_only_what_the_run_wrote_is_deleted_and_an_out_inside_the_run_folder_stays(tiny_clip, files, tmp_path,
                                                                                     capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    interrupted_run(tiny_clip, files, run_dir)
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "rank-0-of-1" / "mine.txt").write_text("mine too")
    runner.score_many(metrics(tiny_clip), *_lists(files), run_dir=run_dir)  # resumes, finishes, cleans up
    assert tree(run_dir) == {"notes.txt": b"mine", "rank-0-of-1/mine.txt": b"mine too"}
    inside = tmp_path / "run2"
    inside.mkdir()
    out = inside / "scores.jsonl"
    code, _, err = cli(score_cmd(tiny_clip, files, out, "--run-dir", str(inside)), capsys)
    assert code == 0, err
    assert sorted(tree(inside)) == ["scores.jsonl"] and len(out.read_text().splitlines()) == N
    code, _, err = cli(score_cmd(tiny_clip, files, inside / "run.json", "--run-dir", str(inside)), capsys)
    assert code == 2 and "a file name capeval uses in the run folder" in err


def test_a_run_folder_the_run_made_goes_when_it_is_done(tiny_clip, files, tmp_path):
    """With the folders the run made above it (empty), never one that was there before."""
    run_dir = tmp_path / "made" / "run"
    runner.score_many(metrics(tiny_clip), *_lists(files), run_dir=run_dir)
    assert not run_dir.exists() and not (tmp_path / "made").exists() and tmp_path.is_dir()


# ---------------------------------------------------------------------------------------------------------
# 2. One run at a time; every record checked against its run


HOLD = """
import sys, time
from capeval_plugins.checkpoint import RunStore
store = RunStore(sys.argv[1])
store.open({"metrics": {}, "inputs": "other"})
print("holding", flush=True)
time.sleep(3600)  # until the test kills it: however slow the machine, it holds the folder meanwhile
"""


def test_a_second_run_is_refused_while_one_runs_and_a_killed_holder_blocks_nothing(tiny_clip, files, tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([PYTHON, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(RunFolderError, match=f"in use by another capeval run \\(pid {holder.pid} on "):
            runner.run(metrics(tiny_clip), corpus_of(files), run_dir=run_dir)
    finally:
        holder.kill()  # kill -9: the kernel drops its lock
        holder.wait()
    outcome = runner.run(metrics(tiny_clip), corpus_of(files), run_dir=run_dir)  # its unfinished run had no batch
    assert outcome.batches_resumed == 0 and outcome.run_id


def test_records_of_another_run_are_refused_never_merged(tiny_clip, files, tmp_path):
    interrupted_run(tiny_clip, files, tmp_path / "a", after=4)
    interrupted_run(tiny_clip, files, tmp_path / "b", after=2, w=1.0)
    log = "rank-0-of-1/clipscore.log"
    shutil.copyfile(tmp_path / "a" / log, tmp_path / "b" / log)  # a second writer's records in b's log
    # (authenticated with a's key: they do not verify under b's)
    with pytest.raises(RunFolderError, match="damaged run folder .* record 0 .*not of this run.*restart=True"):
        runner.run(metrics(tiny_clip, w=1.0), corpus_of(files), run_dir=tmp_path / "b")
    outcome = runner.run(metrics(tiny_clip, w=1.0), corpus_of(files), run_dir=tmp_path / "b", restart=True)
    assert outcome.batches_resumed == 0


def test_records_without_their_run_json_are_refused_never_reused(tiny_clip, files, tmp_path):
    run_dir = tmp_path / "run"
    interrupted_run(tiny_clip, files, run_dir)
    (run_dir / "run.json").unlink()
    images, captions, references = _lists(files)
    other = runner.Corpus(captions[::-1], images, references)  # another caption file, same length
    with pytest.raises(RunFolderError, match="run.json is missing but finished batches are there"):
        runner.run(metrics(tiny_clip), other, run_dir=run_dir)
    fresh = runner.run(metrics(tiny_clip), other, run_dir=run_dir, restart=True)
    alone = runner.run(metrics(tiny_clip), other)
    assert fresh.batches_resumed == 0
    # float32 CLIP, same batches: equal up to rounding; reused scores of the other caption file would not be
    torch.testing.assert_close(fresh.results["clipscore"].scores, alone.results["clipscore"].scores,
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# 3. Inputs by content


def test_an_image_replaced_by_one_of_the_same_size_and_time_is_a_different_input(tiny_clip, files, tmp_path):
    _, folder, _ = files
    run_dir = tmp_path / "run"
    interrupted_run(tiny_clip, files, run_dir)
    target = folder / "00.png"
    stat = target.stat()
    data = bytearray(target.read_bytes())
    data[-20] ^= 0xFF  # other bytes, the same size and modification time
    target.write_bytes(bytes(data))
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert target.stat().st_size == stat.st_size and target.stat().st_mtime_ns == stat.st_mtime_ns
    with pytest.raises(InputError, match="inputs differ"):
        runner.run(metrics(tiny_clip), corpus_of(files), run_dir=run_dir)


def test_new_weights_in_the_same_model_folder_are_a_different_model(tiny_clip, files, tmp_path):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_clip, model)
    run_dir = tmp_path / "run"
    interrupted_run(str(model), files, run_dir)
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k, v in tensors.items() if v.is_floating_point() and v.numel() > 1)
    tensors[name] = tensors[name].flip(0).contiguous()
    size = weights.stat().st_size
    save_file(tensors, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == size
    with pytest.raises(InputError, match="clipscore options model"):
        runner.run(metrics(str(model)), corpus_of(files), run_dir=run_dir)


# ---------------------------------------------------------------------------------------------------------
# 8. Damaged state: one line, naming restart the caller's way


@pytest.mark.parametrize("damage", ["flip mid.sums", "truncate mid.sums", "flip run.json"])
def test_damaged_state_is_refused_in_one_line_naming_restart(tiny_clip, files, tmp_path, capsys, damage):
    out = tmp_path / "s.jsonl"
    run_dir = Path(f"{out}.capeval-run")
    # the CLI's run: -m clipscore -m mid, batch 4 for both
    with pytest.raises(runner.Interrupted):
        ms = {"clipscore": capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4),
              "mid": capeval_plugins.load("mid", model=tiny_clip, batch_size=4)}
        runner.run(ms, cli_corpus(files), run_dir=run_dir, stop=StopAfter(5))
    how, name = damage.split()
    path = run_dir / ("rank-0-of-1" if name.endswith("sums") else "") / name
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) - 7]
    path.write_bytes(bytes(data))
    with pytest.raises(RunFolderError, match="damaged run folder .*use restart=True to start over"):
        runner.run(ms, cli_corpus(files), run_dir=run_dir)
    code, _, err = cli(score_cmd(tiny_clip, files, out), capsys)
    assert code == 2 and err.count("\n") == 1 and "damaged run folder" in err and "use --restart" in err, err
    assert "restart=True" not in err
    code, _, err = cli(score_cmd(tiny_clip, files, out, "--restart"), capsys)
    assert code == 0, err


def cli_corpus(files):
    from capeval_plugins.caption_files import read_captions

    captions, folder, _ = files
    records = read_captions(captions, folder)
    return runner.Corpus(records.captions, records.images, records.references, describe=records.describe)


# ---------------------------------------------------------------------------------------------------------
# Issue 18.3: a failed run blocks nothing; a changed run names the caller's flag


def test_a_run_that_finished_no_batch_leaves_nothing_behind(tiny_clip, files, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"

    def fails(*args, **kwargs):
        raise RuntimeError("model load failed")

    monkeypatch.setattr("capeval_plugins.session.loop.full_spec", fails)
    with pytest.raises(RuntimeError):
        runner.run(metrics(tiny_clip), corpus_of(files), run_dir=run_dir)
    assert not run_dir.exists()
    monkeypatch.undo()
    other = {"clipscore": capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4)}  # the corrected run
    assert runner.run(other, corpus_of(files), run_dir=run_dir).batches_resumed == 0


def test_a_changed_metric_set_names_restart_true_in_python_and_the_flag_on_the_cli(tiny_clip, files, tmp_path,
                                                                                      capsys):
    out = tmp_path / "s.jsonl"
    with pytest.raises(runner.Interrupted):
        ms = {"clipscore": capeval_plugins.load("clipscore", model=tiny_clip, batch_size=4),
              "mid": capeval_plugins.load("mid", model=tiny_clip, batch_size=4)}
        runner.run(ms, cli_corpus(files), run_dir=f"{out}.capeval-run", stop=StopAfter(2))
    with pytest.raises(RunFolderError) as err:
        runner.run({"clipscore": ms["clipscore"]}, cli_corpus(files), run_dir=f"{out}.capeval-run")
    assert "metric mid removed" in str(err.value) and "restart=True" in str(err.value)
    assert "--restart" not in str(err.value)
    code, _, err = cli(score_cmd(tiny_clip, files, out)[:3] + score_cmd(tiny_clip, files, out)[5:], capsys)
    assert code == 2 and "metric mid removed" in err and "--restart" in err and "restart=True" not in err


# ---------------------------------------------------------------------------------------------------------
# Outputs


def test_json_out_is_one_array_and_jsonl_stays_lines(tiny_clip, files, tmp_path, capsys):
    assert cli(score_cmd(tiny_clip, files, tmp_path / "s.json"), capsys)[0] == 0
    assert cli(score_cmd(tiny_clip, files, tmp_path / "s.jsonl"), capsys)[0] == 0
    rows = json.loads((tmp_path / "s.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert isinstance(rows, list) and rows == lines and len(rows) == N


def test_out_equal_to_the_caption_file_is_refused(tiny_clip, files, capsys):
    captions, _, _ = files
    before = captions.read_bytes()
    code, _, err = cli(score_cmd(tiny_clip, files, captions), capsys)
    assert code == 2 and "is an input of this run" in err
    assert captions.read_bytes() == before


def test_parquet_keeps_the_error_column_when_the_first_row_was_scored(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    table = [{"index": 0, "m": 0.5}, {"index": 1, "m": None, "error": "m: bad image"}]
    write_table(tmp_path / "s.parquet", table)
    assert pq.read_table(tmp_path / "s.parquet").to_pylist() == [{**table[0], "error": None}, table[1]]


WRITER = """
import sys
from capeval_plugins.caption_files import write_table
tag, path, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [{"index": i, "writer": tag, "text": "x" * 50} for i in range(20000)]
for _ in range(rounds):
    write_table(path, rows)
"""


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_two_writers_of_one_path_leave_one_whole_table(tmp_path, suffix):
    out = tmp_path / f"s{suffix}"
    procs = [subprocess.Popen([PYTHON, "-c", WRITER, tag, str(out), "15"]) for tag in "ab"]
    seen = set()
    while any(p.poll() is None for p in procs):
        if out.exists():
            seen.add(_whole_writer(out))
        time.sleep(0.01)
    assert all(p.returncode == 0 for p in procs)
    seen.add(_whole_writer(out))
    assert seen <= {"a", "b"}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def _whole_writer(out: Path) -> str:
    text = out.read_text()
    lines = text.splitlines()[1:] if out.suffix == ".csv" else text.splitlines()
    writers = {("a" if '"a"' in line or ",a," in line else "b") for line in lines}
    assert len(lines) == 20000 and len(writers) == 1, (len(lines), writers)
    return writers.pop()


# ---------------------------------------------------------------------------------------------------------
# Interruptions in real processes: a second Ctrl-C, kill -9 at random moments, two runs on one --out


def _capeval(model, files, out, script=None):
    return [PYTHON, script or "-m", *(() if script else ("capeval_plugins.cli",))] + score_cmd(model, files, out)


@pytest.mark.slow
def test_a_second_ctrl_c_exits_130_without_a_traceback_and_the_run_resumes(tiny_clip, files, tmp_path, capsys):
    whole = tmp_path / "whole.jsonl"
    assert cli(score_cmd(tiny_clip, files, whole), capsys)[0] == 0
    out = tmp_path / "s.jsonl"
    env = {**os.environ, "CAPEVAL_TEST_STOP_AFTER": "3", "CAPEVAL_TEST_SIGINTS": "2"}
    proc = subprocess.run(_capeval(tiny_clip, files, out, INTERRUPT), capture_output=True, text=True, env=env,
                          timeout=HANG_GUARD)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "capeval: interrupted; finished batches are saved in" in proc.stderr
    assert cli(score_cmd(tiny_clip, files, out), capsys)[0] == 0
    assert out.read_text() == whole.read_text()


@pytest.mark.slow
def test_kill_9_at_random_moments_then_the_same_command_gives_the_uninterrupted_output(tiny_clip, files, tmp_path,
                                                                                        capsys):
    whole = tmp_path / "whole.jsonl"
    start = time.monotonic()
    proc = subprocess.run(_capeval(tiny_clip, files, whole), capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    took = time.monotonic() - start
    out = tmp_path / "s.jsonl"
    rng = random.Random(23)
    for _ in range(3):
        victim = subprocess.Popen(_capeval(tiny_clip, files, out), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.4, 1.0) * took)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    code, _, err = cli(score_cmd(tiny_clip, files, out), capsys)
    assert code == 0, err
    assert out.read_text() == whole.read_text()
    assert not Path(f"{out}.capeval-run").exists()


@pytest.mark.slow
def test_two_runs_on_one_out_never_mix(tiny_clip, files, tmp_path, capsys):
    whole = tmp_path / "whole.jsonl"
    assert cli(score_cmd(tiny_clip, files, whole), capsys)[0] == 0
    out = tmp_path / "s.jsonl"
    procs = [subprocess.Popen(_capeval(tiny_clip, files, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [(p.wait(timeout=HANG_GUARD), p.stderr.read()) for p in procs]
    for code, err in results:
        assert code == 0 or (code == 2 and "in use by another capeval run" in err), err[-3000:]
    assert any(code == 0 for code, _ in results)
    assert out.read_text() == whole.read_text()
    assert not Path(f"{out}.capeval-run").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".s.jsonl")]


def test_lock_and_manifest_are_the_run_folders_only_extra_files(tiny_clip, files, tmp_path):
    run_dir = tmp_path / "run"
    interrupted_run(tiny_clip, files, run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([LOCK, MANIFEST, "rank-0-of-1", "run.json"])
    store = RunStore(run_dir)
    store.remove()
    assert not run_dir.exists()
