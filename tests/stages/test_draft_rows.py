"""Execute's side of drafts planned a step ahead: rows moved back by the drafts their request's
last step rejected, placeholders filled by the model-free proposer, and unfilled ones dropped."""

from __future__ import annotations

import numpy as np

from stages.draft_rows import Behind, Proposer, trim
from stages.speculative_config import SpeculativeConfig

BLOCK = 4


def _rows(starts: list[int], lengths: list[int], tables: list[list[int]]):
    """A step's arrays as the plan ring has them for rows starting at `starts`."""
    query_start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate(
        [np.arange(a, a + n) for a, n in zip(starts, lengths, strict=True)]
    ).astype(np.int64)
    block_tables = np.array(tables, np.int32)
    row_of = np.repeat(np.arange(len(starts)), lengths)
    slots = block_tables[row_of, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    context = (np.array(starts) + np.array(lengths)).astype(np.int32)
    return query_start_loc, positions, slots, context, block_tables


def test_a_row_planned_before_its_rejections_were_known_moves_back_by_them():
    behind = Behind(BLOCK)
    # request 7's last row started at 10 with 4 draft positions and accepted one: the next
    # starts at 12, not at the 15 schedule assumed
    behind.verified(7, first_position=10, reserved=4, accepted=1)
    behind.verified(8, first_position=20, reserved=2, accepted=2)  # all accepted: where planned
    qsl, positions, slots, context, tables = _rows([15, 23], [3, 1], [[1, 2, 3, 4, 5, 0], [6] * 6])
    handles = np.array([7, 8], np.int64)
    behind.rebase(handles, qsl, positions, slots, context, tables)
    assert positions.tolist() == [12, 13, 14, 23]
    assert context.tolist() == [15, 24]
    # position 12 is the first of block index 3 (block 4): slots 16, 17, 18
    assert slots.tolist() == [16, 17, 18, 6 * BLOCK + 3]
    # once moved, a request is where it is: a later row is left alone
    qsl, positions, slots, context, tables = _rows([15], [1], [[1, 2, 3, 4, 5]])
    behind.rebase(np.array([7], np.int64), qsl, positions, slots, context, tables)
    assert positions.tolist() == [15]


def test_a_row_planned_on_the_result_already_is_left_where_it_is():
    behind = Behind(BLOCK)
    behind.verified(7, first_position=10, reserved=4, accepted=0)
    qsl, positions, slots, context, tables = _rows([11], [1], [[1, 2, 3, 4]])  # it knew
    behind.rebase(np.array([7], np.int64), qsl, positions, slots, context, tables)
    assert positions.tolist() == [11] and context.tolist() == [12]
    assert not behind  # nothing left to move


def test_trim_drops_the_positions_nobody_has_a_draft_for():
    qsl = np.array([0, 5, 6, 9], np.int32)  # rows of 1 + 4 drafts, 1, and 1 + 2 drafts
    ids = np.array([1, 50, 51, -1, -1, 2, 3, 60, -1], np.int64)
    positions = np.array([10, 11, 12, 13, 14, 7, 30, 31, 32], np.int64)
    context = np.array([15, 8, 33], np.int32)
    num_draft = np.array([4, 0, 2], np.int32)
    starts, (ids, positions), context, num_draft = trim(
        qsl, [ids, positions], context, num_draft, np.array([2, 0, 1])
    )
    assert starts.tolist() == [0, 3, 4, 6]
    assert ids.tolist() == [1, 50, 51, 2, 3, 60]
    assert positions.tolist() == [10, 11, 12, 7, 30, 31]
    assert context.tolist() == [13, 8, 32] and num_draft.tolist() == [2, 0, 1]


def test_the_proposer_looks_up_the_request_tokens_it_was_sent_and_emitted():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    proposer = Proposer(spec)
    proposer.admit(3, np.array([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], np.int32), 11)  # e.g. cached
    proposer.emitted(3, [8])
    ids = np.array([8, -1, -1, -1, -1], np.int64)  # the input token, then four positions
    kept = proposer.fill(np.array([3], np.int64), np.array([0, 5]), ids, np.array([4]))
    # after [..., 7, 8] lookup proposes what followed [6, 7, 8] earlier: 5, 6, 7, 8
    assert kept.tolist() == [4] and ids.tolist() == [8, 5, 6, 7, 8]
    proposer.admit(4, np.array([1, 2, 3], np.int32), 3)  # nothing repeats: nothing filled
    ids = np.array([3, -1, -1], np.int64)
    kept = proposer.fill(np.array([4], np.int64), np.array([0, 3]), ids, np.array([2]))
    assert kept.tolist() == [0] and ids.tolist() == [3, -1, -1]


def test_suffix_drafts_come_from_what_an_earlier_request_emitted():
    spec = SpeculativeConfig.parse('{"method": "suffix", "num_speculative_tokens": 4}')
    proposer = Proposer(spec)
    proposer.admit(1, np.array([1, 2, 3], np.int32), 3)
    for token in (40, 41, 42, 43, 44, 45):
        proposer.emitted(1, [token])
    proposer.forget(1)  # its outputs go to the cache of recent outputs
    proposer.admit(2, np.array([1001, 1002, 1003, 40, 41], np.int32), 3)
    ids = np.array([41, -1, -1, -1, -1], np.int64)
    kept = proposer.fill(np.array([2], np.int64), np.array([0, 5]), ids, np.array([4]))
    assert kept.tolist() == [2] and ids[:3].tolist() == [41, 42, 43]  # a match of 2: two drafts
