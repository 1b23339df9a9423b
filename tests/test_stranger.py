"""A stranger's first hour (issue 52): each mistake a new user made gets one line saying what to do, and each
thing they could not find is shown. Every test here failed on the code before."""
from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path

import pytest
from conftest import EXAMPLES, HANG_GUARD, ROOT, capeval_in_process


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("capeval: error: "), proc.stderr
    return lines[0]


def test_make_demo_says_how_to_put_capeval_on_the_path():
    """`make demo` installs capeval into .venv, which is not on a stranger's PATH: the demo's last line says how."""
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(ROOT), "-o", ".venv/.installed", "demo"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stderr
    assert "source .venv/bin/activate" in proc.stdout and ".venv/bin/capeval" in proc.stdout
    assert "source .venv/bin/activate" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------
# forgetting --images


def test_forgetting_images_is_one_line_naming_the_folder_searched_and_the_option(tiny_clip, tmp_path):
    """examples/photos.jsonl names its photos relative to a folder `make demo` writes: without --images they are
    looked up beside the caption file, and none is there. One line (not one per sample) names that folder and
    --images; a wrong --images folder is named the same way."""
    base = ["score", "-m", "clipscore", "--model", tiny_clip, "--captions", EXAMPLES / "photos.jsonl", "--quiet"]
    line = one_error_line(capeval_in_process(base))
    assert str(EXAMPLES) in line and "--images" in line and "14" not in line and "7 image files" in line
    wrong = one_error_line(capeval_in_process([*base, "--images", tmp_path]))
    assert f"--images {tmp_path}" in wrong
    # with --on-error skip too: nothing could be scored
    assert "--images" in one_error_line(capeval_in_process([*base, "--on-error", "skip"]))


def test_forgetting_images_under_torchrun_is_said_by_rank_0_only(tiny_clip, monkeypatch):
    """Every rank reads the same caption file and finds the same folder empty: the line is rank 0's, as every
    other error of the shared input validation is (one line for the run, not one per rank)."""
    base = ["score", "-m", "clipscore", "--model", tiny_clip, "--captions", EXAMPLES / "photos.jsonl", "--quiet"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    proc = capeval_in_process(base)
    assert proc.returncode == 2 and proc.stderr == "", proc.stderr
    monkeypatch.setenv("RANK", "0")
    assert "--images" in one_error_line(capeval_in_process(base))


def test_a_few_missing_images_are_still_each_samples_own_error(tiny_clip, tmp_path):
    """When some images are found, the missing ones are the samples' problems: listed by row, as before."""
    captions = tmp_path / "captions.jsonl"
    rows = [json.loads(line) for line in (EXAMPLES / "captions.jsonl").read_text().splitlines()]
    rows[1]["image"] = "no-such-photo.jpg"
    captions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = capeval_in_process(["score", "-m", "clipscore", "--model", tiny_clip, "--captions", captions,
                               "--images", EXAMPLES / "images", "--quiet"])
    assert proc.returncode == 2 and "sample 1 (captions.jsonl line 2)" in proc.stderr, proc.stderr
    assert "image file not found" in proc.stderr and "none of the" not in proc.stderr


def test_text_metrics_never_look_for_images():
    proc = capeval_in_process(["score", "-m", "bleu1", "-o", "tokenize=false", "--captions", EXAMPLES / "photos.jsonl",
                               "--quiet"])
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------------------
# a benchmark name typed wrong


@pytest.mark.parametrize("args", [["bench", "flickr8-expert", "--metric", "cider"],
                                  ["reproduce", "--benchmark", "flickr8-expert", "--dry-run"],
                                  ["reproduce", "--metric", "cider", "--data", "flickr8-expert=x.json", "--dry-run"]])
def test_a_benchmark_typo_is_one_line_with_did_you_mean(args):
    line = one_error_line(capeval_in_process(args))
    assert "no benchmark named 'flickr8-expert'; did you mean 'flickr8k-expert'" in line


def test_bench_help_still_lists_the_benchmarks():
    proc = capeval_in_process(["bench", "--help"])
    assert proc.returncode == 0 and "flickr8k-expert" in proc.stdout and "longcaparena-testb-flu" in proc.stdout


# ---------------------------------------------------------------------------------------------------------
# capeval cache: every cache, with sizes; clear removes what capeval wrote


def tiny_bpe(path: Path) -> Path:
    """A CLIP BPE file in OpenAI's format (a header line, then merges) with a handful of merges."""
    merges = ["t h", "th e</w>", "a n", "an d</w>", "d o", "do g</w>"]
    path.write_bytes(gzip.compress(("#version: 0.2\n" + "\n".join(merges) + "\n").encode()))
    return path


def released_pacs_beside_its_bpe(folder: Path) -> Path:
    from capeval_plugins.testing import official

    folder.mkdir(parents=True, exist_ok=True)
    bpe = tiny_bpe(folder / "bpe_simple_vocab_16e6.txt.gz")
    return official.released_pacs(folder / "clip_ViT-B-32.pth", bpe=bpe)


def test_capeval_cache_lists_and_clears_every_cache_the_package_writes(tmp_path, monkeypatch):
    from capeval_plugins import files
    from capeval_plugins.bench import fetch
    from capeval_plugins.bench.cache import ScoreCache, default_cache_path
    from capeval_plugins.commands import fetch_weights

    cache = tmp_path / "cache"
    monkeypatch.setenv("CAPEVAL_CACHE", str(cache))
    # a converted model in the default folder, a fetched benchmark (written as the fetcher writes), a score cache
    converted = capeval_in_process(["convert", "pacs", released_pacs_beside_its_bpe(tmp_path / "release"), "--backbone",
                                    "vit-b-32"])
    assert converted.returncode == 0, converted.stderr
    claim = files.Claim(fetch.cache_root(), fetch.KIND).open()
    claim.write(f"composite/{fetch.MANIFEST}", b'{"format": 1}\n')
    claim.write("composite/data.json", b"[]" + b" " * 300_000)
    claim.folder.close()
    # a release fetch-weights downloaded (written as the downloader writes)
    claim = files.Claim(fetch_weights.cache_root(), fetch_weights.KIND).open()
    claim.write("pacs-vit-b-32/clip_ViT-B-32.pth", b"\0" * 200_000)
    claim.folder.close()
    ScoreCache(default_cache_path()).close()
    # what is not the package's: a folder of the user's beside the models, a file in the benchmarks folder
    (cache / "models" / "mine").mkdir()
    (cache / "models" / "mine" / "weights.bin").write_bytes(b"the user's")
    (cache / "benchmarks" / "notes.txt").write_text("the user's")
    (cache / "weights" / "notes.txt").write_text("the user's")

    shown = capeval_in_process(["cache"])
    assert shown.returncode == 0, shown.stderr
    assert "pacs-vit-b-32: converted by capeval convert" in shown.stdout
    assert "composite: fetched from yuwd/Composite" in shown.stdout and "0.3 MB" in shown.stdout
    assert f"score cache of capeval bench / reproduce (--cache, --no-cache): {default_cache_path()}" in shown.stdout
    assert "mine: not capeval's" in shown.stdout
    assert "released files downloaded by capeval fetch-weights" in shown.stdout
    assert "pacs-vit-b-32: clip_ViT-B-32.pth from https://" in shown.stdout
    info = json.loads(capeval_in_process(["cache", "--json"]).stdout)
    assert {e["name"] for e in info["models"]["entries"]} == {"pacs-vit-b-32", "mine"}
    assert info["scores"]["bytes"] > 0 and info["benchmarks"]["bytes"] > 300_000
    assert [e["name"] for e in info["weights"]["entries"]] == ["pacs-vit-b-32"] and info["weights"]["bytes"] >= 200_000

    only = capeval_in_process(["cache", "clear", "--only", "scores"])
    assert only.returncode == 0 and not default_cache_path().exists() and (cache / "models" / "pacs-vit-b-32").is_dir()
    cleared = capeval_in_process(["cache", "clear"])
    assert cleared.returncode == 0, cleared.stderr
    assert "converted models" in cleared.stdout and "fetched benchmarks" in cleared.stdout
    assert "downloaded weights" in cleared.stdout and not (cache / "weights" / "pacs-vit-b-32").exists()
    assert (cache / "weights" / "notes.txt").read_text() == "the user's"
    assert not (cache / "models" / "pacs-vit-b-32").exists() and not (cache / "benchmarks" / "composite").exists()
    assert (cache / "models" / "mine" / "weights.bin").read_bytes() == b"the user's"
    assert (cache / "benchmarks" / "notes.txt").read_text() == "the user's"
    assert "kept " in cleared.stdout and "mine" in cleared.stdout


# ---------------------------------------------------------------------------------------------------------
# capeval convert pacs|polos: where it writes, which tokenizer


@pytest.mark.parametrize("kind", ["pacs", "polos"])
def test_convert_help_shows_the_default_destination_and_that_the_tokenizer_default_is_a_hub_id(kind, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "somewhere"))
    proc = capeval_in_process(["convert", kind, "--help"])
    text = "".join(proc.stdout.split())  # argparse wraps long words at their hyphens
    assert proc.returncode == 0
    assert str(tmp_path / "somewhere" / "models" / ("pacs-vit-b-32" if kind == "pacs" else "polos")) in text
    assert "hubidopenai/clip-vit-base-patch32" in text and "besidethecheckpoint" in text


def test_convert_pacs_takes_the_bpe_beside_the_checkpoint_offline(tmp_path, monkeypatch):
    """The released repositories ship bpe_simple_vocab_16e6.txt.gz: beside the checkpoint it is the default, so
    the conversion needs no hub (the hub id was the only default before, and failed offline)."""
    monkeypatch.setenv("CAPEVAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = released_pacs_beside_its_bpe(tmp_path / "release")
    proc = capeval_in_process(["convert", "pacs", source, tmp_path / "out", "--backbone", "vit-b-32", "--json"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokenizers"]["CLIP"] == str(source.parent / "bpe_simple_vocab_16e6.txt.gz")
    # a folder holding the file works as --tokenizer too
    again = capeval_in_process(["convert", "pacs", source, tmp_path / "out2", "--backbone", "vit-b-32", "--tokenizer",
                                source.parent, "--json"])
    assert again.returncode == 0, again.stderr
    from transformers import CLIPTokenizer

    assert len(CLIPTokenizer.from_pretrained(tmp_path / "out2")) == len(CLIPTokenizer.from_pretrained(tmp_path / "out"))


# ---------------------------------------------------------------------------------------------------------
# the training readers, capeval reproduce


@pytest.mark.parametrize("fmt", ["rows", "flickr8k-expert"])
def test_a_missing_training_file_is_called_a_training_file(tmp_path, fmt):
    from capeval_plugins.inputs import InputError
    from capeval_plugins.training.data import read_judgments

    with pytest.raises(InputError, match="^training file not found") as err:
        read_judgments(tmp_path / "train.jsonl", format=fmt)
    assert "benchmark" not in str(err.value)


def test_a_missing_aligner_caption_file_is_called_a_training_file(tmp_path):
    from capeval_plugins.inputs import InputError
    from capeval_plugins.training.msd_aligner.data import read_captions

    with pytest.raises(InputError, match="^training caption file not found"):
        read_captions(tmp_path / "chat.json")


def test_a_dry_run_says_a_reason_several_rows_share_once(monkeypatch, tmp_path):
    """SPICE's missing jars made every SPICE row carry the same long reason, twice (one per jar): now one line for
    both jars, said once below the table, each row pointing at it."""
    from capeval_plugins.metrics import coco

    monkeypatch.setattr(coco, "spice_jars", lambda: (tmp_path / "lib" / "a.jar", tmp_path / "lib" / "b.jar"))
    proc = capeval_in_process(["reproduce", "--metric", "spice", "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| SPICE |")]
    assert len(rows) > 2 and all(row.endswith("| no: see [1] |") for row in rows), rows
    notes = [line for line in proc.stdout.splitlines() if line.startswith("[1] ")]
    assert len(notes) == 1 and f"needs a.jar and b.jar in {tmp_path / 'lib'}, which do not exist" in notes[0]
    assert proc.stdout.count("a.jar") == 1


def test_data_for_a_benchmark_without_a_published_value_is_said_not_used(tmp_path):
    data = tmp_path / "vatex.json"
    data.write_text("{}")
    proc = capeval_in_process(["reproduce", "--metric", "cider", "--data", f"vatex-eval={data}",
                               "--scores", f"fleur:composite={data}", "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("capeval: note: ")]
    assert any(f"--data vatex-eval={data} is not used" in n and "no published value on vatex-eval" in n
               for n in notes), proc.stderr
    assert any(f"--scores fleur:composite={data} is not used" in n for n in notes), proc.stderr
