"""The classic metrics' run grows linearly with its rows: no step of it walks every row again for each row, and what
stays in memory per row is a few packed arrays, not Python objects (issue 55 item 3, issue 49 item 6). Counted,
never timed: each test counts the work or the objects that a quadratic step or a per-row object would multiply."""
from __future__ import annotations

import torch

from capeval_plugins.caption_files import CaptionRecords, score_table
from capeval_plugins.contract import MetricResult


class CountingList(list):
    """A list that counts how often it is walked from the start."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_the_score_table_walks_the_image_column_a_bounded_number_of_times_whatever_the_rows():
    """It used to ask "does any record name an image?" once per row: 200,000 rows walked 200,000 x 200,000 names."""
    def walks(n: int) -> int:
        CountingList.walks = 0
        records = CaptionRecords(images=[None] * n, captions=[f"caption {i}" for i in range(n)],
                                 references=[["a"]] * n, groups=[None] * n, lines=list(range(1, n + 1)),
                                 image_names=CountingList([None] * n), path="c.jsonl")
        result = MetricResult("bleu4", 0.5, torch.full((n,), 0.5, dtype=torch.float64), torch.arange(n))
        table = score_table({"bleu4": result}, records)
        assert [row["caption"] for row in table] == records.captions and "image" not in table[0]
        return CountingList.walks

    assert walks(300) == walks(3) <= 2
