"""cuda_decode_fp8.py off the GPU: every reason a launch cannot take the CUDA kernel is named (the Triton kernels serve
it then), and the kernel's source compiles for sm_90 wherever NVRTC is found (CUDA builds of torch ship it; a CPU
machine has it from the nvidia-cuda-nvrtc wheel, which scripts/test.sh's setup puts in .venv/nvrtc, or from
CPATTN_NVRTC=/path/to/libnvrtc.so). The kernel's results: tests/gpu/test_cuda_decode_fp8_gpu.py."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from cpattn.attention.backends import cuda_decode_fp8 as cd


def test_every_reason_is_named():
    q = torch.zeros(1, 32, 64, dtype=torch.float32)
    cache = torch.zeros(4, 12, 8, 64, dtype=torch.float8_e5m2)
    idx = torch.zeros(1, dtype=torch.int64)
    why = cd.fp8_cuda_unserved({"fp8_cuda": True}, q, cache, torch.ones(2, 4, 8), 2, None, 30.0, (idx, idx))
    for words in ("not e4m3", "query groups", "head size 64", "pages of 12", "bf16 / f16", "int32", "CUDA device"):
        assert any(words in w for w in why), (words, why)
    assert cd.fp8_cuda_unserved({}, q, cache, None, 1, None, None, ()) == [
        "the configuration does not ask for it (fp8_cuda)"]


# Where scripts/test.sh's setup puts the nvidia-cuda-nvrtc wheel on a CPU machine (Linux x86_64).
SETUP_NVRTC = Path(__file__).resolve().parents[1] / ".venv" / "nvrtc" / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"


def _nvrtc() -> ctypes.CDLL | None:
    for name in (os.environ.get("CPATTN_NVRTC"), "libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so",
                 str(SETUP_NVRTC) if SETUP_NVRTC.exists() else None):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    return None


@pytest.mark.parametrize("g, q_kind, out_kind, extra", [(4, 1, 0, []), (16, 2, 1, []), (1, 1, 2, []), (3, 1, 0, []),
                                                       (4, 1, 0, ["-DVSWZ=1"]), (8, 1, 1, ["-DVSWZ=1", "-DHPB=1"])])
def test_source_compiles_for_sm90(g, q_kind, out_kind, extra):
    lib = _nvrtc()
    if lib is None:
        pytest.skip("no NVRTC library here (set CPATTN_NVRTC)")
    cubin = cd.nvrtc_compile(lib, cd.SOURCE.read_text(), ["--gpu-architecture=sm_90", "--use_fast_math", f"-DG={g}",
                                                           f"-DQ_KIND={q_kind}", f"-DOUT_KIND={out_kind}",
                                                           f"-I{cd.SOURCE.parent}", *extra])
    assert cubin[:4] == b"\x7fELF" and cd.KERNEL.encode() in cubin


def test_a_compile_error_carries_the_log():
    lib = _nvrtc()
    if lib is None:
        pytest.skip("no NVRTC library here (set CPATTN_NVRTC)")
    with pytest.raises(RuntimeError, match="NVRTC could not compile"):
        cd.nvrtc_compile(lib, "this is not CUDA", ["--gpu-architecture=sm_90"])
