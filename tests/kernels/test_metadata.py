"""`MetadataBuilder.build_common` (`kernels/metadata.py`): the block tables it copies step after step."""

import contextlib

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


class _Interrupting:
    """The block-table buffer, raising KeyboardInterrupt right after its `armed`-th write (a Ctrl-C
    between the copy and the bookkeeping of what the buffer holds)."""

    def __init__(self, array):
        self.array, self.armed = array, 0

    def __getitem__(self, key):
        return self.array[key]

    def __setitem__(self, key, value):
        self.array[key] = value
        self.armed -= 1
        if self.armed == 0:
            raise KeyboardInterrupt


def test_an_interrupt_mid_copy_leaves_the_next_step_right():
    """Whatever write an interrupt follows, the next step's tables are what it asks for, even one that
    starts as the interrupted step's rows held before (where a stale record would copy only a tail)."""
    for armed in (1, 2, 3):  # a row rewritten whole, a row's new tail, the padded rows' zeros
        builder = MetadataBuilder(4, 64, 8, BLOCK, torch.device("cpu"))
        real = builder._host_arrays["block_tables"]
        assert _held(builder, [[1, 2], [3, 4], [5, 6]]) == [[1, 2], [3, 4], [5, 6]]
        wrapper = _Interrupting(real)
        wrapper.armed = armed
        builder._host_arrays["block_tables"] = wrapper
        with contextlib.suppress(KeyboardInterrupt):
            builder.build_common(_layout([[7, 8], [3, 4, 9]]), 3)  # the third row padded
        builder._host_arrays["block_tables"] = real
        assert _held(builder, [[1, 2, 10], [3, 4, 11], [5, 6, 12]]) == [[1, 2, 10], [3, 4, 11], [5, 6, 12]]
