"""Which prompt a processor's row began with (`server/prompt_rows.py`)."""

import pytest
import torch

from hfaccel.server.prompt_rows import PromptRows, prefix_clash


@pytest.mark.parametrize(
    ("prompts", "clash"),
    [
        ([[1, 2], [1, 2, 3]], (1, 0)),
        ([[1, 2, 3], [4], [1, 2]], (0, 2)),
        ([[1, 2], [1, 2], [1, 3]], None),  # equal prompts count alike
        ([[1, 2], [2, 1], [1]], (0, 2)),
        ([[1, 2], [1, 3]], None),
    ],
)
def test_a_prompt_that_begins_with_another_is_found(prompts, clash):
    assert prefix_clash(prompts) == clash
    if clash is not None:
        with pytest.raises(ValueError, match=f"prompt {clash[0]} begins with prompt {clash[1]}"):
            PromptRows(prompts)


def test_each_row_is_matched_to_its_prompt():
    rows = PromptRows([[7, 8], [5, 6, 7], [7, 8]])
    assert rows.generated(torch.tensor([5, 6, 7, 8, 8])).tolist() == [8, 8]
    assert rows.generated(torch.tensor([7, 8])).tolist() == []
    with pytest.raises(ValueError, match="none of the call's prompts"):
        rows.prompt_length(torch.tensor([9, 9]))
    assert PromptRows([[1, 2, 3]]).generated(torch.tensor([1, 2, 3, 4])).tolist() == [4]
