"""`capeval` command line: list, score (one or several metrics, single process and torchrun), output formats,
errors and exit codes, interruption and resume."""
from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import EXAMPLES, HANG_GUARD, PYTHON, capeval_here, capeval_in_process, cli, free_port, one_line, random_image, run

import capeval_plugins
from capeval_plugins.caption_files import read_captions

CAPEVAL = str(Path(PYTHON).parent / "capeval")
TORCHRUN = str(Path(PYTHON).parent / "torchrun")
INTERRUPT = str(Path(__file__).parent / "helpers" / "interrupt_after.py")


def direct(model, name="clipscore", **options):
    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    return capeval_plugins.load(name, model=model, **options)(records.images, records.captions, records.references)


def score_args(model, out=None, *metrics, extra=()):
    args = [CAPEVAL, "score", *[a for m in metrics or ("clipscore",) for a in ("--metric", m)], "--model", model,
            "--captions", str(EXAMPLES / "captions.jsonl"), "--images", str(EXAMPLES / "images"), "--quiet"]
    return args + (["--out", str(out)] if out else []) + list(extra)


def strict_json(text):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_list_names_every_metric_and_its_source():
    out = capeval_here(["list"]).stdout
    assert "clipscore" in out and "refclipscore" in out and "capeval-plugins:builtin" in out
    rows = json.loads(capeval_here(["list", "--json"]).stdout)
    clip = next(r for r in rows if r["name"] == "clipscore")
    assert clip["references"] == "optional" and clip["images"] == "always"


def test_score_writes_one_row_per_sample_in_input_order(tiny_clip, tmp_path):
    out = tmp_path / "scores.jsonl"
    proc = run(score_args(tiny_clip, out, extra=["--batch-size", "2", "-o", "reference_extras=true"]))
    summary = strict_json(proc.stdout.strip().splitlines()[-1])
    rows = [strict_json(line) for line in out.read_text().splitlines()]
    expected = direct(tiny_clip, reference_extras=True)
    assert [r["index"] for r in rows] == list(range(len(expected)))
    assert [r["clipscore"] for r in rows] == pytest.approx(expected.scores.tolist(), abs=1e-5)
    assert [r["clipscore.refclipscore"] for r in rows] == pytest.approx(expected.extras["refclipscore"].tolist(), abs=1e-5)
    clip = summary["metrics"]["clipscore"]
    assert clip["score"] == pytest.approx(expected.score, abs=1e-5)
    assert summary["n"] == len(expected) and summary["n_skipped"] == 0 and clip["n_invalid"] == 0
    assert not Path(f"{out}.capeval-run").exists()  # the checkpoint folder goes once the output is written


def test_several_metrics_in_one_pass_equal_single_metric_runs(tiny_clip, tmp_path):
    out = tmp_path / "scores.csv"
    capeval_here(score_args(tiny_clip, out, "clipscore", "refclipscore", "msd_score",
                            extra=["-o", "clipscore.w=1.0"])[1:])
    rows = list(csv.DictReader(out.open()))
    for name, options in (("clipscore", {"w": 1.0}), ("refclipscore", {}), ("msd_score", {})):
        expected = direct(tiny_clip, name, **options)
        assert [float(r[name]) for r in rows] == pytest.approx(expected.scores.tolist(), abs=1e-5), name
    assert [float(r["msd_score.bi_kl"]) for r in rows] == pytest.approx(
        direct(tiny_clip, "msd_score").extras["bi_kl"].tolist(), abs=1e-5)


def test_parquet_output(tiny_clip, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "scores.parquet"
    capeval_here(score_args(tiny_clip, out, "clipscore", "msd_score")[1:])
    table = pq.read_table(out).to_pylist()
    assert [r["index"] for r in table] == list(range(6))
    assert [r["clipscore"] for r in table] == pytest.approx(direct(tiny_clip).scores.tolist(), abs=1e-5)


def mistake(args, tmp_path, in_process=False):
    """The exit code and stderr lines of ``capeval ARGS`` run in ``tmp_path``: the installed command, or its
    ``main`` in this process (:func:`conftest.capeval_in_process`, 3 s less a call)."""
    proc = (capeval_in_process(args[1:], cwd=tmp_path) if in_process
            else subprocess.run(args, capture_output=True, text=True, cwd=tmp_path))
    return proc.returncode, proc.stderr.strip().splitlines()


def test_every_mistake_exits_2_with_one_line_naming_it(tiny_clip, tmp_path, monkeypatch):
    caps, imgs = str(EXAMPLES / "captions.jsonl"), str(EXAMPLES / "images")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    base = [CAPEVAL, "score", "--captions", caps, "--images", imgs, "--quiet"]
    cases = {
        "expects a float, got 'abc'": base + ["-m", "clipscore", "--model", tiny_clip, "-o", "w=abc"],
        "no selected metric takes option 'model'": base + ["-m", "bleu4", "--model", "x"],
        "option model: no such file or folder: /nonexistent": base + ["-m", "clipscore", "--model", "/nonexistent"],
        "cannot write": base + ["-m", "clipscore", "--model", tiny_clip, "--out", str(tmp_path / "no" / "dir.jsonl")],
        "cannot write /proc/capeval.jsonl": base + ["-m", "clipscore", "--model", tiny_clip, "--out",
                                                    "/proc/capeval.jsonl"],
        "holds no captions": [CAPEVAL, "score", "-m", "clipscore", "--model", tiny_clip, "--captions", str(empty)],
        "did you mean": base + ["-m", "clipscor"],
        "clipscore takes no option 'nope'": base + ["-m", "clipscore", "--model", tiny_clip, "-o", "clipscore.nope=1"],
        "names metric 'bleu4', which is not selected": base + ["-m", "clipscore", "-o", "bleu4.n=2"],
        "on_error must be one of": base + ["-m", "clipscore", "--model", tiny_clip, "-o", "on_error=maybe"],
    }
    monkeypatch.chdir(tmp_path)
    for n, (expected, args) in enumerate(cases.items()):
        # the first through the installed command (a real process); the rest in-process: same main(), and a
        # process start each would cost the suite 3 s
        code, lines = mistake(args, tmp_path, in_process=n > 0)
        assert code == 2 and len(lines) == 1, (expected, code, lines)
        assert lines[0].startswith("capeval: error:") and expected in lines[0], (expected, lines)
    assert not (tmp_path / "no").exists()


def corpus_with_a_corrupt_image(tmp_path, n=400, bad=250, n_images=40):
    """A caption file of ``n`` rows (the example captions, two per image) over ``n_images`` random images; row
    ``bad`` points at a file that is not an image."""
    images = tmp_path / "images"
    images.mkdir()
    for k in range(n_images):
        random_image(k, size=(24 + k % 7, 20 + k % 5)).save(images / f"{k:03d}.png")
    (images / "corrupt.png").write_bytes(b"\x89PNG but not really")
    rows = [json.loads(line) for line in (EXAMPLES / "captions.jsonl").read_text().splitlines()]
    out = []
    for i in range(n):
        source = rows[i % len(rows)]
        row = dict(source, caption=f"{source['caption']} ({i})",
                   references=[f"{r} ({i // 2})" for r in source["references"]],
                   image="corrupt.png" if i == bad else f"{(i // 2) % n_images:03d}.png")
        out.append(json.dumps(row))
    path = tmp_path / "captions.jsonl"
    path.write_text("\n".join(out) + "\n")
    return path, images


def not_a_model(tmp_path):
    """A folder that exists (so the path check passes) but holds no model: loading it would fail loudly."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    return str(folder)


def test_a_corrupt_image_is_named_by_its_row_before_any_model_loads(tmp_path, monkeypatch):
    from capeval_plugins import cli
    from capeval_plugins.resources import loading

    captions, images = corpus_with_a_corrupt_image(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(loading, "load_processor", refuse)
    code = cli.main(["score", "-m", "clipscore", "-m", "mid", "--model", not_a_model(tmp_path), "--captions",
                     str(captions), "--images", str(images), "--out", str(tmp_path / "s.jsonl")])
    assert code == 2
    assert not (tmp_path / "s.jsonl").exists() and not (tmp_path / "s.jsonl.capeval-run").exists()


def test_the_cli_error_names_row_250_and_its_line(tmp_path):
    captions, images = corpus_with_a_corrupt_image(tmp_path)
    code, lines = mistake([CAPEVAL, "score", "-m", "clipscore", "--model", not_a_model(tmp_path), "--captions",
                           str(captions), "--images", str(images), "--quiet"], tmp_path)
    assert code == 2 and len(lines) == 1
    assert "sample 250 (captions.jsonl line 251): cannot read image" in lines[0] and "corrupt.png" in lines[0]


@pytest.mark.slow
def test_torchrun_names_row_250_too(tmp_path):
    captions, images = corpus_with_a_corrupt_image(tmp_path)
    proc = subprocess.run([TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m",
                           "capeval_plugins.cli", "score", "-m", "clipscore", "--model", not_a_model(tmp_path),
                           "--captions", str(captions), "--images", str(images), "--quiet"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode != 0
    assert "sample 250 (captions.jsonl line 251): cannot read image" in proc.stderr
    assert "cannot load model" not in proc.stderr  # the check came first


def test_skip_scores_the_rest_and_writes_strict_json(tiny_clip, tmp_path):
    captions, images = corpus_with_a_corrupt_image(tmp_path, n=12, bad=5)
    out = tmp_path / "scores.jsonl"
    proc = capeval_here(["score", "-m", "clipscore", "--model", tiny_clip, "--captions", str(captions), "--images",
                         str(images), "--out", str(out), "--on-error", "skip", "--quiet"])
    assert "NaN" not in out.read_text() and "NaN" not in proc.stdout
    rows = [strict_json(line) for line in out.read_text().splitlines()]
    summary = strict_json(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 12 and rows[5]["clipscore"] is None and "cannot read image" in rows[5]["error"]
    assert summary["n_skipped"] == 1 and summary["metrics"]["clipscore"]["n_skipped"] == 1
    records = read_captions(captions, images)
    keep = [i for i in range(12) if i != 5]
    alone = capeval_plugins.load("clipscore", model=tiny_clip)(
        [records.images[i] for i in keep], [records.captions[i] for i in keep],
        [records.references[i] for i in keep], ids=keep)
    assert [rows[i]["clipscore"] for i in keep] == alone.scores.tolist()  # the others: exactly as without it


def interrupted(cmd, stop_after, env):
    """Run ``cmd`` with a real SIGINT after it has scored ``stop_after`` batches (see helpers/interrupt_after.py)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD,
                          env={**env, "CAPEVAL_TEST_STOP_AFTER": str(stop_after)})


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_same_bits(tiny_clip, tmp_path):
    """A real SIGINT in a process of its own; the uninterrupted run and the resume need none (cli.main here, as
    the kill -9 test of tests/test_run_folders.py resumes too)."""
    import os

    captions, images = corpus_with_a_corrupt_image(tmp_path, n=120, bad=-1)

    def command(out):
        return ["score", "-m", "clipscore", "-m", "mid", "--model", tiny_clip, "--batch-size", "8",
                "--captions", str(captions), "--images", str(images), "--out", str(out), "--quiet"]

    whole = tmp_path / "whole.jsonl"
    capeval_here(command(whole))
    out = tmp_path / "resumed.jsonl"
    first = interrupted([PYTHON, INTERRUPT, *command(out)], 7, dict(os.environ))
    assert first.returncode == 130, first.stderr[-2000:]
    assert "interrupted after 7 of 30 batches" in first.stderr and "run the same command again to resume" in first.stderr
    assert "batches mapped by this process: 7" in first.stderr and not out.exists()
    second = capeval_here(command(out))
    assert out.read_text() == whole.read_text()  # bit for bit: JSON floats round-trip exactly
    summary = strict_json(second.stdout.strip().splitlines()[-1])
    assert summary["batches_resumed"] == 7 and summary["batches_scored"] == 2 * 15 - 7
    assert not Path(f"{out}.capeval-run").exists()


@pytest.mark.slow
def test_a_changed_command_is_refused_and_restart_starts_over(tiny_clip, tmp_path):
    import os

    out = tmp_path / "s.jsonl"
    args = score_args(tiny_clip, out, extra=["--batch-size", "2"])[1:]
    first = interrupted([PYTHON, INTERRUPT, *args], 1, dict(os.environ))
    assert first.returncode == 130
    changed = capeval_in_process([*args, "-o", "w=1.0"])  # what follows needs no process of its own
    assert changed.returncode == 2 and "clipscore options w" in changed.stderr and "--restart" in changed.stderr
    again = capeval_here([*args, "-o", "w=1.0", "--restart"])
    summary = strict_json(again.stdout.strip().splitlines()[-1])
    assert summary["batches_resumed"] == 0 and summary["batches_scored"] == 3


def torchrun_score(model, captions, images, out, script=("-m", "capeval_plugins.cli"), quiet=True):
    """``torchrun`` with two ranks scoring CLIPScore and MID (a corpus-level metric) in batches of 8."""
    return [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), *script, "score", "-m", "clipscore",
            "-m", "mid", "--model", model, "--batch-size", "8", "--captions", str(captions), "--images",
            str(images), "--out", str(out), *(["--quiet"] if quiet else [])]


@pytest.fixture(scope="module")
def torchrun_whole(tiny_clip, tmp_path_factory):
    """One uninterrupted two-rank run (a torchrun costs three interpreters' imports): the corpus, its output and
    the run's stderr, for the tests below. Not quiet: its progress bars are under test too."""
    folder = tmp_path_factory.mktemp("torchrun")
    captions, images = corpus_with_a_corrupt_image(folder, n=64, bad=-1)
    whole = folder / "whole.jsonl"
    proc = run(torchrun_score(tiny_clip, captions, images, whole, quiet=False), timeout=HANG_GUARD)
    return captions, images, whole, proc.stderr


@pytest.mark.slow
def test_torchrun_two_ranks_equals_one_process(tiny_clip, torchrun_whole):
    captions, images, whole, _ = torchrun_whole
    rows = [strict_json(line) for line in whole.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(64))
    assert [r["clipscore"] for r in rows] == pytest.approx(direct_rows(tiny_clip, captions, images), abs=1e-5)


@pytest.mark.slow
def test_under_torchrun_only_rank_0_draws_progress_bars(torchrun_whole):
    stderr = torchrun_whole[3]
    lines = [line.strip() for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    # a bar drawn at its last update and again when closed (as tqdm does when the update came after its refresh
    # interval, i.e. on a busy machine) is one bar: the same bar's consecutive lines are taken once
    drawn = [re.match(r"([\w, ]+): +(\d+)%\|", line) for line in lines]
    drawn = [(m.group(1), m.group(2)) for m in drawn if m]
    finished = [name for i, (name, pct) in enumerate(drawn) if pct == "100" and drawn[i - 1:i] != [(name, "100")]]
    # rank 0's bars only (its model loading, the pass, the corpus step): each once, never one per rank
    assert finished.count("clipscore, mid") == 1 and finished.count("corpus scores") == 1, stderr[-3000:]
    assert len(finished) == len(set(finished)), finished


@pytest.mark.slow
def test_torchrun_interrupted_and_resumed_equals_an_uninterrupted_torchrun(tiny_clip, torchrun_whole):
    import os

    captions, images, whole, _ = torchrun_whole
    env = dict(os.environ)
    out = whole.parent / "resumed.jsonl"
    first = interrupted(torchrun_score(tiny_clip, captions, images, out, script=(INTERRUPT,)), 2, env)
    assert first.returncode != 0 and not out.exists()
    assert sorted(p.name for p in Path(f"{out}.capeval-run").iterdir()) == [
        "capeval-run.lock", "capeval-run.manifest", "rank-0-of-2", "rank-1-of-2", "run.json"]
    second = subprocess.run(torchrun_score(tiny_clip, captions, images, out, script=(INTERRUPT,)), capture_output=True,
                            text=True, timeout=HANG_GUARD, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert out.read_text() == whole.read_text()  # bit for bit
    summary = strict_json(second.stdout.strip().splitlines()[-1])
    assert summary["batches_resumed"] == 4 and summary["batches_scored"] == 2 * 2 * 4 - 4


def direct_rows(model, captions, images):
    records = read_captions(captions, images)
    return capeval_plugins.load("clipscore", model=model)(records.images, records.captions, records.references).scores.tolist()


def test_torchrun_text_states_with_a_long_caption_equal_one_process(tmp_path):
    """The classic metrics' texts go from rank to rank packed (PackedTexts): the two-rank corpus scores and rows
    equal one process's, with one 100 kB caption among short ones."""
    rows = [json.loads(line) for line in (EXAMPLES / "captions.jsonl").read_text().splitlines()] * 3
    rows[4] = {**rows[4], "caption": " ".join(["a red ball on green grass"] * 4000)}
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps({k: r[k] for k in ("caption", "references")}) + "\n" for r in rows))
    args = ["score", "-m", "bleu4", "-m", "cider", "-o", "tokenize=false", "--captions", str(captions), "--quiet"]
    capeval_here([*args, "--out", str(tmp_path / "one.jsonl")])
    run([TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "capeval_plugins.cli", *args,
         "--out", str(tmp_path / "two.jsonl"), "--batch-size", "2"], timeout=HANG_GUARD)
    one, two = ([json.loads(line) for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                for n in ("one", "two"))
    assert len(one) == len(two) == len(rows)
    for a, b in zip(one, two):
        assert a.pop("caption") == b.pop("caption")  # the rows carry their input beside the scores
        assert a == pytest.approx(b, rel=1e-12)


@pytest.mark.parametrize("kind", ["clip", "roberta", "deberta_v3"])  # BPE, WordPiece and Unigram tokenizers
def test_tiny_builds_a_loadable_checkpoint_and_prints_only_its_path(tmp_path, kind):
    out = run([CAPEVAL, "tiny", kind, str(tmp_path / kind)]).stdout
    assert out == f"{tmp_path / kind}\n"  # nothing else: scripts read it (the tokenizer trainers draw no bars)
    assert (tmp_path / kind / "model.safetensors").is_file() and (tmp_path / kind / "config.json").is_file()


def test_signals_finish_the_batch_then_stop_and_stop_at_once_outside_the_batches():
    import os

    from capeval_plugins import runner

    with runner.stop_on_signals() as stop:
        stop.scoring = True  # as the runner sets it while it scores batches
        assert not stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop()
        with pytest.raises(KeyboardInterrupt):  # a second one: at once
            os.kill(os.getpid(), signal.SIGTERM)
    with runner.stop_on_signals() as stop:  # loading, digesting, validating: nothing would poll the flag
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# --- the files users of these tools already have -----------------------------------------------------------------

def _coco_files(tmp_path):
    """A COCO annotation file (captions_val2014.json's shape) over the example images, and a results file
    ([{"image_id", "caption"}], what pycocotools' loadRes reads) with one caption per image (the first of each
    image's in the example captions; pycocoevalcap's scorers assert one, and so does capeval)."""
    everything = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    first = sorted({Path(p).name: k for k, p in reversed(list(enumerate(everything.images)))}.values())
    records = SimpleNamespace(**{field: [getattr(everything, field)[k] for k in first]
                                 for field in ("images", "captions", "references")})
    names = list(dict.fromkeys(Path(p).name for p in records.images))
    refs = {Path(p).name: r for p, r in zip(records.images, records.references)}
    annotations = {"info": {}, "licenses": [], "type": "captions",
                   "images": [{"id": 100 + k, "file_name": n} for k, n in enumerate(names)],
                   "annotations": [{"image_id": 100 + k, "id": 10 * k + j, "caption": c}
                                   for k, n in enumerate(names) for j, c in enumerate(refs[n])]}
    results = [{"image_id": 100 + names.index(Path(p).name), "caption": c}
               for p, c in zip(records.images, records.captions)]
    (tmp_path / "captions_val2014.json").write_text(json.dumps(annotations))
    (tmp_path / "results.json").write_text(json.dumps(results, indent=2))
    return tmp_path / "results.json", tmp_path / "captions_val2014.json", records


def test_a_coco_results_file_with_its_annotation_file(tiny_clip, tmp_path):
    """`--captions results.json --annotations captions_val2014.json --images DIR`: each result scored against
    its image's annotated captions, its image the annotation's file_name under --images; the rows carry the
    image id, the image and the caption beside the scores."""
    results, annotations, records = _coco_files(tmp_path)
    out = tmp_path / "scores.jsonl"
    capeval_here(["score", "-m", "refclipscore", "--model", tiny_clip, "--captions", str(results), "--annotations",
                  str(annotations), "--images", str(EXAMPLES / "images"), "--out", str(out), "--quiet"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = capeval_plugins.load("refclipscore", model=tiny_clip)(records.images, records.captions,
                                                                     records.references)
    assert [r["refclipscore"] for r in rows] == pytest.approx(expected.scores.tolist(), abs=1e-5)
    assert [r["caption"] for r in rows] == records.captions
    assert [r["image"] for r in rows] == [Path(p).name for p in records.images]
    assert [r["image_id"] for r in rows] == [json.loads(results.read_text())[k]["image_id"] for k in range(len(rows))]


def test_bert_score_plain_text_files(tmp_path):
    """bert-score's `-r refs.txt -c cands.txt` (one per line; several -r files: several references), an empty
    line an empty candidate, scored."""
    cands = ["a dog runs on the grass", "", "a red car"]
    refs = [["a dog on grass", "a cat sits", "a red car parked"], ["a brown dog", "two cats", "a car"]]
    (tmp_path / "cands.txt").write_text("\n".join(cands) + "\n")
    for k, (column, end) in enumerate(zip(refs, ("\r\n", "\r"))):  # Windows, then old-Mac line ends (bert-score's
        (tmp_path / f"refs{k}.txt").write_bytes((end.join(column) + end).encode())  # universal newlines read both)
    out = tmp_path / "scores.jsonl"
    capeval_here(["score", "-m", "cider", "-o", "tokenize=false", "-c", str(tmp_path / "cands.txt"),
                  "-r", str(tmp_path / "refs0.txt"), str(tmp_path / "refs1.txt"), "--out", str(out), "--quiet"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = capeval_plugins.load("cider", tokenize=False)(None, cands, [list(r) for r in zip(*refs)])
    assert [r["cider"] for r in rows] == pytest.approx(expected.scores.tolist(), rel=1e-12)
    assert [r["caption"] for r in rows] == cands and "image" not in rows[0] and rows[1]["cider"] == 0.0


def test_a_file_in_another_known_format_says_which_and_how_to_pass_it(tmp_path):
    results, annotations, _ = _coco_files(tmp_path)
    (tmp_path / "cands.txt").write_text("a dog runs\na cat\n")
    base = [CAPEVAL, "score", "-m", "bleu4", "--quiet"]
    cases = {
        "is a COCO results file ([{\"image_id\", \"caption\"}]): pass it with --captions and its annotation file "
        "with --annotations": base + ["--captions", str(results)],
        "is a COCO annotation file (references, not candidates): pass it with --annotations": base + [
            "--captions", str(annotations)],
        "is plain text, not JSON Lines: for one candidate caption per line (bert-score's files) pass it with -c":
            base + ["--captions", str(tmp_path / "cands.txt")],
        "give either -c/-r": base + ["--captions", str(results), "-c", str(tmp_path / "cands.txt")],
        "give the captions to score": base,
    }
    for n, (expected, args) in enumerate(cases.items()):  # the first as a real process, the rest in-process
        code, lines = mistake(args, tmp_path, in_process=n > 0)
        assert code == 2 and len(lines) == 1 and expected in lines[0], (expected, lines)


def test_out_rows_carry_the_input_and_no_repeated_columns(tiny_clip, tmp_path):
    out = tmp_path / "scores.jsonl"
    capeval_here(score_args(tiny_clip, out, "clipscore", "refclipscore")[1:])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    records = read_captions(EXAMPLES / "captions.jsonl", EXAMPLES / "images")
    source = [json.loads(line) for line in (EXAMPLES / "captions.jsonl").read_text().splitlines()]
    assert list(rows[0])[:3] == ["index", "image", "caption"]
    assert [r["image"] for r in rows] == [s["image"] for s in source] and [r["caption"] for r in rows] == records.captions
    # RefCLIPScore's clipscore and cosine extras repeat CLIPScore's columns: each value once (CLIPScore leaves
    # the references to RefCLIPScore, whose reference_similarity is its own)
    assert set(rows[0]) == {"index", "image", "caption", "clipscore", "clipscore.cosine",
                            "refclipscore.reference_similarity", "refclipscore"}


@pytest.mark.parametrize("batch_size", [None, 2, 3])
def test_refclipscores_clipscore_is_clipscores_own_bits_at_any_batch_size(tiny_clip, batch_size):
    """RefCLIPScore encoded its candidates with their references: the candidate features came out of other
    chunks, a float32 step apart (1e-7), so with --batch-size (or a corpus past one batch) the table wrote
    RefCLIPScore's clipscore and cosine beside CLIPScore's, where the docs say they are one column."""
    import random

    import torch

    from capeval_plugins import runner

    rng = random.Random(0)
    words = "a red blue ball car tree sun sky on the road in green yellow big small".split()
    images = sorted(str(p) for p in (EXAMPLES / "images").iterdir())
    n = 90
    sentence = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(2, 12)))  # noqa: E731
    captions, refs = [sentence() for _ in range(n)], [[sentence() for _ in range(rng.randint(1, 4))] for _ in range(n)]
    options = {} if batch_size is None else {"batch_size": batch_size}
    metrics = {name: capeval_plugins.load(name, model=tiny_clip, **options) for name in ("clipscore", "refclipscore")}
    results = runner.score_many(metrics, [images[i % len(images)] for i in range(n)], captions, refs)
    clip, ref = results["clipscore"], results["refclipscore"]
    assert torch.equal(clip.scores, ref.extras["clipscore"]) and torch.equal(clip.extras["cosine"], ref.extras["cosine"])


def test_a_tables_columns_do_not_depend_on_the_data(tiny_root, tmp_path):
    """BERTScore's f1 is its score by definition and is left out; its precision and recall stay even where they
    equal the score on every row (each caption equal to its reference: P = R = F = 1). Before, the table
    dropped any extra equal to its metric's score on every row, so such a run wrote no precision column."""
    from capeval_plugins.testing import tiny_checkpoint

    model = tiny_checkpoint("bert", root=tiny_root)
    captions = tmp_path / "captions.jsonl"
    texts = ["a dog runs on the grass", "two children play in a park"]
    captions.write_text("".join(json.dumps({"caption": t, "references": [t]}) + "\n" for t in texts))
    out = tmp_path / "scores.jsonl"
    capeval_here(["score", "-m", "bertscore", "--model", str(model), "--captions", str(captions), "--out", str(out),
                  "--quiet"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(abs(r["bertscore"] - 1) < 1e-5 for r in rows)  # a caption equal to its reference
    assert {"bertscore", "bertscore.precision", "bertscore.recall"} <= set(rows[0]), rows[0]
    assert "bertscore.f1" not in rows[0]


def test_one_model_for_metrics_of_different_kinds_is_refused_before_loading(tiny_clip, tmp_path):
    code, lines = mistake(score_args(tiny_clip, None, "clipscore", "bertscore"), tmp_path)
    assert code == 2 and len(lines) == 1
    assert "bertscore cannot use it: it is a clip checkpoint" in lines[0] and "-o bertscore.model=..." in lines[0]


def test_realistic_photos_help_prints_help_and_writes_nothing(tmp_path):
    proc = run([PYTHON, "-m", "capeval_plugins.testing.realistic", "--help"], cwd=str(tmp_path))
    assert proc.stdout.startswith("usage:") and not any(tmp_path.iterdir())


def test_an_image_id_given_twice_with_two_file_names_is_refused(tmp_path, capsys):
    """pycocotools keeps the last entry; an image metric silently scored the caption against that file."""
    results, annotations, _ = _coco_files(tmp_path)
    gt = json.loads(annotations.read_text())
    gt["images"].append({"id": gt["images"][0]["id"], "file_name": "another.jpg"})
    annotations.write_text(json.dumps(gt))
    code, _, err = cli(["score", "-m", "bleu4", "-o", "tokenize=false", "--captions", results, "--annotations",
                        annotations, "--quiet"], capsys)
    assert code == 2 and one_line(err) and "gives image id 100 again, with another file_name" in err, err
    gt["images"][-1]["file_name"] = gt["images"][0]["file_name"]  # the same entry twice: one image, as given
    annotations.write_text(json.dumps(gt))
    assert cli(["score", "-m", "bleu4", "-o", "tokenize=false", "--captions", results, "--annotations", annotations,
                "--quiet"], capsys)[0] == 0


@pytest.mark.parametrize("args", [["score", "-m", "bleu4", "--captions", str(EXAMPLES / "captions.jsonl"), "--out", ""],
                                  ["score", "-m", "bleu4", "--captions", str(EXAMPLES / "captions.jsonl"),
                                   "--run-dir", " "],
                                  ["bench", "composite", "--json", ""], ["score", "-m", "bleu4", "--captions", ""]])
def test_an_empty_path_is_refused_not_read_as_absent(args, capsys):
    """``--out "$OUT"`` with OUT unset scored, wrote nothing and said nothing (exit 0)."""
    code, _, err = cli(args, capsys)
    assert code == 2 and one_line(err) and "an empty path" in err, err
