"""Seed 000's worked example ("Runner 先构造公共事实"), number for number.

Requests A (decode, 128 tokens after the step), B (4-token prefill, new), C (3-token extend of 32).
"""

import torch

from cpattn.attention import make_causal_metadata
from cpattn.attention.batch_split import split_decodes_and_prefills
from cpattn.kvstore import PAD_BLOCK_ID, block_table_to_csr

BLOCK_SIZE = 16
ROWS = [[7, 2, 9, 4, 11, 6, 3, 10], [5], [1, 8, 12]]


def worked_example_block_table() -> torch.Tensor:
    table = torch.full((3, 8), PAD_BLOCK_ID, dtype=torch.int64)
    for r, row in enumerate(ROWS):
        table[r, :len(row)] = torch.tensor(row)
    return table


def test_common_metadata_matches_seed():
    md = make_causal_metadata(query_lens=[1, 4, 3], context_lens=[127, 0, 32],
                              block_table_BW=worked_example_block_table(), block_size=BLOCK_SIZE)
    assert md.query_start_loc_cpu.tolist() == [0, 1, 5, 8]
    assert md.seq_lens_cpu.tolist() == [128, 4, 35]
    assert md.max_query_len == 4 and md.max_seq_len == 128 and md.num_actual_tokens == 8
    assert md.slot_mapping.tolist() == [175, 80, 81, 82, 83, 192, 193, 194]
    assert md.slot_mapping.dtype == torch.int64
    # Invariant 4: seq_len - query_len = context readable before the step.
    assert (md.seq_lens_cpu - md.query_lens_cpu).tolist() == [127, 0, 32]


def test_flashinfer_csr_matches_seed():
    indptr, indices, last_page_len = block_table_to_csr(worked_example_block_table(), [128, 4, 35], BLOCK_SIZE)
    assert indptr.tolist() == [0, 8, 9, 12]
    assert indices.tolist() == [7, 2, 9, 4, 11, 6, 3, 10, 5, 1, 8, 12]
    assert last_page_len.tolist() == [16, 4, 3]


def test_flashinfer_split_matches_seed():
    split = split_decodes_and_prefills(torch.tensor([0, 1, 5, 8]))
    assert (split.num_decodes, split.num_decode_tokens) == (1, 1)
    assert (split.num_prefills, split.num_prefill_tokens) == (2, 7)
    assert split.prefill_qo_indptr.tolist() == [0, 4, 7]
    assert split.is_identity
