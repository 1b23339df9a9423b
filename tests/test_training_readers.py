"""`capeval train` data: a value of the wrong type is refused by its row, never read as something else."""
from __future__ import annotations

import csv
import json

import pytest
from conftest import random_image

from capeval_plugins.inputs import InputError
from capeval_plugins.training import data as judgment_data
from capeval_plugins.training.msd_aligner import data as caption_data


@pytest.fixture
def folder(tmp_path):
    for i, name in enumerate(["a.png", "b.png", "f0.png", "f1.png"]):
        random_image(i).save(tmp_path / name)
    return tmp_path


def write_rows(path, rows):
    path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("candidate", [5, ["a dog", "a cat"], {"text": "a dog"}])
def test_a_candidate_that_is_not_a_string_is_refused(folder, candidate):
    """str() made 5 the caption "5" and a list the caption "['a dog', 'a cat']"."""
    path = write_rows(folder / "rows.json", [{"image": "a.png", "candidate": candidate, "score": 0.5}])
    with pytest.raises(InputError, match="row 0: the candidate caption must be a string"):
        judgment_data.read_judgments(path)


def test_a_boolean_score_is_refused(folder):
    path = write_rows(folder / "rows.json", [{"image": "a.png", "caption": "A dog.", "score": True}])
    with pytest.raises(InputError, match="row 0: human score True is not a number"):
        judgment_data.read_judgments(path)


def test_csv_cells_holding_json_lists_read_as_lists_and_bad_ones_are_refused_by_row(folder):
    path = folder / "rows.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, ["frames", "caption", "ratings"])
        writer.writeheader()
        writer.writerow({"frames": json.dumps(["f0.png", "f1.png"]), "caption": "A dog.", "ratings": "[1, 0]"})
    data = judgment_data.read_judgments(path)
    assert data.samples.images[0].kind == "video" and len(data.samples.images[0].value) == 2
    assert data.scores.tolist() == [0.5] and data.raters.tolist() == [2]
    with open(path, "a", newline="") as f:
        csv.writer(f).writerow(["['f0.png'", "A cat.", "[1]"])
    with pytest.raises(InputError, match=r"row 1: frames must be a list \(a JSON list in a CSV cell\)"):
        judgment_data.read_judgments(path)  # was a raw JSONDecodeError traceback


def test_a_ratings_cell_that_is_not_json_is_refused_by_row(folder):
    path = write_rows(folder / "rows.json", [{"image": "a.png", "caption": "A dog.", "ratings": "3; 4"}])
    with pytest.raises(InputError, match="row 0: ratings must be a list"):
        judgment_data.read_judgments(path)


def test_aligner_conversations_from_a_csv_cell(folder):
    turns = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "A red square."}]
    path = folder / "chat.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, ["image", "conversations"])
        writer.writeheader()
        writer.writerow({"image": "a.png", "conversations": json.dumps(turns)})
    assert caption_data.read_captions(path).captions == ["A red square."]


@pytest.mark.parametrize("limit", [0, -1, True])
def test_aligner_limit_must_be_a_positive_count(folder, limit):
    """limit=-1 silently dropped the last record (records[:-1])."""
    path = write_rows(folder / "pairs.json", [{"image": "a.png", "caption": "x"}, {"image": "b.png", "caption": "y"}])
    with pytest.raises(InputError, match="limit must be a positive number"):
        caption_data.read_captions(path, limit=limit)
