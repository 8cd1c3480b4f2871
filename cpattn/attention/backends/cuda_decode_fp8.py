"""The TRITON backend's paged decode of an fp8 e4m3 cache as a CUDA kernel on tensor cores (issue 22's <= 0.6x bf16;
DECODE_CONFIG fp8_cuda). The kernel is cuda/fp8_decode.cu, compiled at first use by NVRTC (the runtime compiler every
CUDA build of torch ships, so no CUDA toolkit is needed) and launched through the driver, as torch.cuda's
_compile_kernel does; launches are captured by CUDA graphs like any other.

Legend: T tokens, Q query heads, K kv heads, G = Q / K, D head size (128), PS tokens per page.

Why a CUDA kernel (measured on an H200, benchmarks/RESULTS.md): the Triton kernels convert every cached fp8 value to
16 bits before their dots and stage tiles through shared memory into the dots' layouts; the best of them reads half of
bf16's bytes in 0.84x its time (2.5 TB/s against bf16's 4.2). Triton's SM90 fp8 dot (wgmma) needs M = 64 rows, 60
of them padding at G = 4 (1.29x bf16). Here each warp loads K and V from global memory straight into mma.sync's
operand registers, with no shared memory and no barrier in the key loop:
- q.K as m16n8k32 e4m3 mma: K as stored is the B operand (each key's 128 bytes are its k axis; the k axis is permuted
  the same way for q, which leaves the sum unchanged), q the A operand (G rows of 16) in two e4m3 parts, hi + lo of
  q / qs (qs = the row's largest |q| / 256), so bf16 queries lose nothing: no conversion of K at all.
- P.V as m16n8k16 f16 mma, O^T = V^T P^T: P^T comes from the q.K accumulators of the same thread (keys permuted to
  fit), V is converted e4m3 -> f16 by one cvt per two values after one byte permute per two values (V's rows are the
  contraction axis, which an fp8 B operand cannot take without a transpose).
- fp8 scales (per page and kv head, powers of two): the logits times each page's K scale; P times each page's V scale
  over the largest seen so far (a running maximum, like the softmax's: the accumulator is rescaled when it grows)
  times 2^15 in f16, so probabilities down to 2^-39 of the row's largest keep their value.
- A block of 4 warps per (token, kv head, split) takes 32-key tiles in turn; the warps merge in shared memory at the
  end; the splits merge as the Triton kernels' do (merge_attn_states_triton), or the block writes the rows directly.
  240 registers a thread: 2 blocks (8 warps) per SM.

Measured (2026-12-02, nvidia-h200, benchmarks/fp8_cuda_probe.py, CUDA graph replay): 1M keys B=1 0.549 ms against
bf16's 1.018 (0.54x; before cuda_v_swizzle 0.770; the Triton heads kernel 0.856), B=64 x 32K 0.53x, 4,096 keys 0.51x
(with fill_splits), rel 3-5e-2 vs float64 (the cache's own error); adopted in triton_decode.CONFIG_OVERRIDES["fp8"],
which meets issue 22's 0.6x (benchmarks/RESULTS.md "Session 15").
- P.V's orientation: O^T = V^T P^T puts dims on the mma's rows (no padded rows) and takes P as the B operand
  straight from the q.K accumulators; O = P V (heads on the rows, 12 of 16 padded at G = 4, 0.787 ms) is in git.
- Kept off (session 16, each on top of the adopted config, 1M keys: 0.551-0.718 ms against its 0.547; at B=64
  heads_per_block is 3% faster, at 4,096 keys split_factor 2 is 11%: no clear win everywhere): cuda_heads_per_block (a block's 4 warps take 4 kv
  heads over one split: 512 contiguous bytes per key instead of 128, no cross-warp merge), cuda_min_blocks 3 (168
  registers, 12 warps per SM, small spills) and cuda_stages 3; benchmarks/fp8_cuda_probe.py sweeps them.
- cuda_v_swizzle (adopted, session 15: 0.769 -> 0.551 ms at 1M keys): Nsight Compute on one 1M-key launch had
  found L2 the limit (89% busy at 57% of DRAM bandwidth; the bf16 Triton kernel: 79% of DRAM), V's 8 cp.async
  copies moving twice their sectors because a sector's two 16-byte halves landed in shared-memory slots 64 bytes
  apart; V's chunks are now laid out key-major and swizzled so they stay adjacent (fp8_ops.cuh: v_slot).
- fill_splits (adopted): at short contexts (4,096 keys) launch_splits doubles the splits where the plan's key floor
  per split left the GPU under half full (0.0168 -> 0.0108 ms with cuda_v_swizzle).
- Stages (cuda_stages, 2 adopted): each lane copies its own K and V chunks by cp.async into its warp's ring in shared
  memory, that many tiles deep, and reads back only what it copied; the page ids are loaded one tile earlier.

Served (else the Triton kernels serve): e4m3 caches with per-page scales, plain decodes (one query per program, no
window, no soft cap), D = 128, G <= 16, PS a power of two >= 8, bf16 / f16 queries, int32 indices, compute
capability >= 8.9 (e4m3 mma). Validated against float64 on the GPU (tests/gpu/test_cuda_decode_fp8_gpu.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cuda") / "fp8_decode.cu"
KERNEL = "cpattn_fp8_decode"
THREADS = 128            # NW = 4 warps in the source
STAGE_BYTES = 16 * 512 + 32   # one tile's K and V chunks and scales in a warp's ring (the source's STAGE_BYTES)
E4M3 = torch.float8_e4m3fn
_Q_KIND = {torch.bfloat16: 1, torch.float16: 2}
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def fp8_cuda_unserved(cfg: dict, q: torch.Tensor, k_cache: torch.Tensor, kv_scale, queries: int, key_start,
                      soft_cap, indices: tuple[torch.Tensor, ...]) -> list[str]:
    """Why this launch cannot take the CUDA kernel (empty: it can). ``indices``: block table, tokens, requests and
    key counts."""
    if not cfg.get("fp8_cuda"):
        return ["the configuration does not ask for it (fp8_cuda)"]
    why = []
    if kv_scale is None or k_cache.dtype != E4M3:
        why.append(f"the cache is {k_cache.dtype}, not e4m3 with page scales")
    if queries != 1 or key_start is not None or soft_cap is not None:
        why.append("query groups, windows and soft caps take the Triton kernels")
    _, ps, hk, d = k_cache.shape
    hq = q.shape[1]
    if d != 128 or hq % hk or hq // hk > 16:
        why.append(f"head size {d} (128 only) or {hq} q heads over {hk} kv heads (G <= 16 only)")
    if ps < 8 or ps & (ps - 1):
        why.append(f"pages of {ps} tokens (a power of two >= 8 only)")
    if q.dtype not in _Q_KIND or q.stride(2) != 1 or k_cache.stride(3) != 1:
        why.append("queries not bf16 / f16 with contiguous heads, or a cache whose heads are not contiguous")
    if indices and (indices[0].dtype not in (torch.int32, torch.int64) or any(t.dtype != torch.int32
                                                                               for t in indices[1:])):
        why.append("indices not int32 (the block table int32 or int64)")
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) < (8, 9):
        why.append("not a CUDA device of compute capability >= 8.9 (e4m3 mma)")
    elif not why and nvrtc_missing():
        why.append(nvrtc_missing())
    return why


@functools.lru_cache(maxsize=None)
def nvrtc_missing() -> str:
    """Why NVRTC cannot be loaded ('' when it can): without it the Triton kernels serve (said once, in the log)."""
    try:
        from torch.cuda import _utils as cuda_utils

        cuda_utils._get_gpu_rtc_library()
        return ""
    except (ImportError, AttributeError, OSError) as exc:
        why = f"NVRTC not loadable ({type(exc).__name__}: {exc}): the fp8 decode takes the Triton kernels"
        logging.getLogger("cpattn").warning("%s", why)
        return why


def launch_fp8_cuda(splits: int, grid_tokens: int, args_head: tuple, strides_in: tuple, logit_args: list,
                    out: torch.Tensor, lse: torch.Tensor, direct: bool, common: dict) -> None:
    """One launch over (tokens, K, splits), arguments as triton_decode.paged_decode passes its kernels; ``out`` /
    ``lse`` the output rows (direct: splits == 1) or the split partials [S, T, Q, D] / [S, T, Q]."""
    q, k_cache, v_cache, table, tok, req, lens, _, ks, vs = args_head
    if k_cache.shape[1] & (k_cache.shape[1] - 1):
        raise ValueError(f"pages of {k_cache.shape[1]} tokens: not a power of two")
    stride_qt, stride_qh, skb, sks, skh, svb, svs, svh, stride_btb, stride_sp, scale_div = strides_in
    stages, hpb = int(common.get("cuda_stages", 2)), heads_per_block(common, k_cache.shape[2])
    kernel = _kernel(common["G"], _Q_KIND[q.dtype], _OUT_KIND[out.dtype], table.dtype == torch.int64, stages,
                     hpb > 1, int(common.get("cuda_min_blocks", 2)), bool(common.get("cuda_v_swizzle")),
                     q.device.index or 0)
    if direct:
        o_strides, l_strides = (0, out.stride(0), out.stride(1)), (0, lse.stride(0))
    else:
        o_strides, l_strides = (out.stride(0), out.stride(1), out.stride(2)), (lse.stride(0), lse.stride(1))
    kernel(grid=(grid_tokens, k_cache.shape[2] // hpb, splits), block=(THREADS, 1, 1),
           shared_mem=shared_bytes(common["G"], stages), stream=torch.cuda.current_stream(q.device),
           args=[q, k_cache, v_cache, table, tok, req, lens, ks, vs, out, lse, stride_qt, stride_qh, skb, sks, skh,
                 svb, svs, svh, stride_btb, stride_sp, scale_div, k_cache.shape[1].bit_length() - 1, *o_strides,
                 *l_strides, int(direct), float(logit_args[0])])


def heads_per_block(cfg: dict, num_kv_heads: int) -> int:
    """kv heads a block computes: 4 (one per warp, cuda_heads_per_block) where they divide K, else 1 (the warps share
    one kv head's tiles). The plan's split count is multiplied by it, so the grid keeps as many blocks."""
    return THREADS // 32 if cfg.get("cuda_heads_per_block") and num_kv_heads % (THREADS // 32) == 0 else 1


def shared_bytes(g: int, stages: int) -> int:
    """The kernel's dynamic shared memory: each warp's ring of ``stages`` tiles, reused by the warps' merge."""
    return max(THREADS // 32 * stages * STAGE_BYTES, THREADS // 32 * g * (128 + 2) * 4)


@functools.lru_cache(maxsize=None)
def _kernel(g: int, q_kind: int, out_kind: int, table64: bool, stages: int, hpb: bool, min_blocks: int,
            v_swizzle: bool, device: int):
    """The kernel for G heads per kv head, the query and output dtypes, the block table's, ``stages`` tiles in flight
    per warp, a kv head per warp (``hpb``), the blocks per SM its registers allow and V's shared-memory layout
    (``v_swizzle``: fp8_ops.cuh's v_slot), compiled for CUDA device
    ``device``'s architecture and loaded into its context (a module belongs to one device): ~1 s, once a process."""
    from torch.cuda import _utils as cuda_utils

    with torch.cuda.device(device):
        major, minor = torch.cuda.get_device_capability(device)
        return _load(cuda_utils, [f"--gpu-architecture=sm_{major}{minor}", "--use_fast_math", f"-DG={g}",
                                  f"-DQ_KIND={q_kind}", f"-DOUT_KIND={out_kind}", f"-DSTAGES={stages}",
                                  f"-DHPB={int(hpb)}", f"-DMIN_BLOCKS={min_blocks}", f"-DVSWZ={int(v_swizzle)}",
                                  f"-I{SOURCE.parent}"]
                     + (["-DBT64"] if table64 else []), shared_bytes(g, stages))


def _load(cuda_utils, options: list[str], smem: int):
    cubin = nvrtc_compile(cuda_utils._get_gpu_rtc_library(), SOURCE.read_text(), options)
    kernel = cuda_utils._cuda_load_module(cubin, [KERNEL])[KERNEL]
    kernel.set_shared_memory_config(smem)   # over 48 KB: asked for once
    return kernel


def nvrtc_compile(lib: ctypes.CDLL, source: str, options: list[str]) -> bytes:
    """``source`` compiled by NVRTC (``lib``) to a cubin; a failure raises with the compiler's log."""
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"fp8_decode.cu", 0, None, None))
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        if lib.nvrtcCompileProgram(prog, len(options), opts) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {SOURCE.name} ({' '.join(options)}):\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin))
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _check(lib: ctypes.CDLL, result: int) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {result}: {lib.nvrtcGetErrorString(result).decode()}")
