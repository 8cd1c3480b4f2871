"""The head-size rule: what every GPU kernel here accepts, and so what a ServiceConfig accepts.

Torch-free, so config validation can ask it without loading a backend.
"""

HEAD_SIZE_MULTIPLE = 8
MAX_HEAD_SIZE = 256
HEAD_SIZE_RULE = f"a multiple of {HEAD_SIZE_MULTIPLE} and at most {MAX_HEAD_SIZE}"


def head_size_ok(head_size: int) -> bool:
    """Kernels tile D in steps of 8 (16-byte vector loads at 16 bits) and keep a [D] row in registers up to 256."""
    return head_size > 0 and head_size % HEAD_SIZE_MULTIPLE == 0 and head_size <= MAX_HEAD_SIZE
