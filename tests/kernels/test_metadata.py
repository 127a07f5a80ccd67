"""`MetadataBuilder.build_common` (`kernels/metadata.py`): the block tables it copies step after step."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hfaccel.kernels.metadata import MetadataBuilder, StepLayout

BLOCK = 4


def _layout(tables: list[list[int]]) -> StepLayout:
    return StepLayout(
        query_lens=[1] * len(tables),
        seq_lens=[max(1, len(t) * BLOCK - 1) for t in tables],
        block_tables=tables,
        slot_mapping=list(range(len(tables))),
        num_decodes=len(tables),
    )


def _held(
    builder: MetadataBuilder, tables: list[list[int]], num_padded: int | None = None
) -> list[list[int]]:
    common = builder.build_common(_layout(tables), num_padded)
    return [common.block_tables_cpu[i, : len(t)].tolist() for i, t in enumerate(tables)]


def test_tables_changed_in_place_moved_or_shrunk_are_copied_whole():
    builder = MetadataBuilder(4, 64, 8, BLOCK, torch.device("cpu"))
    a, b = [1, 2, 3], [4, 5]
    assert _held(builder, [a, b]) == [[1, 2, 3], [4, 5]]
    a.append(6)  # grew: only the new entry is written
    assert _held(builder, [a, b]) == [[1, 2, 3, 6], [4, 5]]
    a[1] = 9  # copy on write: the same list, the same length, one entry replaced
    assert _held(builder, [a, b]) == [[1, 9, 3, 6], [4, 5]]
    assert _held(builder, [b, a]) == [[4, 5], [1, 9, 3, 6]]  # sequences in other rows
    del a[2:]
    a.append(7)  # shrunk, then grew back to another table
    assert _held(builder, [b, a]) == [[4, 5], [1, 9, 7]]
    # A padded step zeroes the padded rows; the next step writes whatever sits there afresh.
    common = builder.build_common(_layout([b]), 2)
    assert common.block_tables_cpu[1].tolist() == [0, 0]  # as wide as the step's widest table
    assert _held(builder, [b, a]) == [[4, 5], [1, 9, 7]]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.lists(st.integers(-1, 30), max_size=8), min_size=1, max_size=4), min_size=1, max_size=6
    )
)
def test_every_step_holds_its_tables_whatever_came_before(steps):
    builder = MetadataBuilder(4, 64, 8, BLOCK, torch.device("cpu"))
    for tables in steps:
        assert _held(builder, tables) == tables
