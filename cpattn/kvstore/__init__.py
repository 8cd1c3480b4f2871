"""Paged KV bookkeeping: block pools, block tables, slot mapping, DCP sharding, CSR page tables.

torch only; never imports Ray, cluster/ or attention/.
"""

from cpattn.kvstore.block_pool import BlockPool
from cpattn.kvstore.block_table import PAD_BLOCK_ID, BlockTable
from cpattn.kvstore.csr import block_table_to_csr
from cpattn.kvstore.kernel_blocks import (MultipleOf, expand_block_table, kernel_kv_view,
                                          select_common_kernel_block_size)
from cpattn.kvstore.page_copy import copy_pages
from cpattn.kvstore.sharding import dcp_local_position, dcp_local_seq_len, dcp_local_seq_lens, dcp_owner_rank
from cpattn.kvstore.slot_mapping import PAD_SLOT_ID, compute_slot_mapping

__all__ = [
    "BlockPool", "BlockTable", "PAD_BLOCK_ID", "PAD_SLOT_ID", "MultipleOf", "block_table_to_csr",
    "compute_slot_mapping", "copy_pages", "dcp_local_position", "dcp_local_seq_len", "dcp_local_seq_lens", "dcp_owner_rank",
    "expand_block_table", "kernel_kv_view", "select_common_kernel_block_size",
]
