// cpattn's fp8 e4m3 paged decode on tensor cores (issue 22); the design and its numbers: cuda_decode_fp8.py.
// Compiled at run time by NVRTC with -DG=<q heads per kv head> -DQ_KIND=<1 bf16, 2 f16> -DOUT_KIND=<0 float32 split
// partials, 1 bf16, 2 f16 rows> [-DBT64: an int64 block table] [-DSTAGES=<tiles in flight per warp>] [-DHPB=1]
// [-DMIN_BLOCKS=<n>] [-DVSWZ=1] and this
// directory on the include path (fp8_ops.cuh: no CUDA headers, the conversions are PTX); dynamic shared memory:
// cuda_decode_fp8.shared_bytes.
//
// One block (NW warps) per (decode token, kv head, split); each warp takes 32-key tiles of the split in turn.
// Per tile, thread (g = lane / 4, t = lane % 4) of a warp:
//   q.K  mma m16n8k32 e4m3: A = q's G heads (rows; hi + lo e4m3 parts of q / qs), B = K as stored (for each key its
//        128 bytes are the k axis): no conversion of K. Four n-tiles of 8 keys; the k axis is permuted (thread t's
//        two 16-byte loads of a key are its columns), the same for q, so the sum is the same.
//   P.V  mma m16n8k16 f16 as O^T = V^T P^T: A = V^T (dims on the rows, so none padded), converted e4m3 -> f16 by
//        one cvt per two values after one byte permute per two (thread g's dims 16 g .. 16 g + 15: one 16-byte load
//        per key), B = P^T from the q.K accumulators as the same thread holds them.
// fp8 scales: q.K by each page's K scale; P by each page's V scale over the warp's largest so far (powers of two,
// exact) times 2^15 (f16 keeps probabilities down to 2^-39 of the row's largest), the accumulator rescaled when the
// largest grows, as the running maximum of the softmax is.

#define NW 4
#ifndef STAGES
#define STAGES 3          // tiles in flight per warp (cp.async groups)
#endif
#define STAGE_BYTES (16 * 512 + 32)
#ifndef HPB
#define HPB 0             // 1: a block's warps are NW kv heads over one split (each its own rows), 0: one kv head
#endif
#ifndef VSWZ
#define VSWZ 0            // 1: V's chunks key-major and swizzled in shared memory (fp8_ops.cuh: v_slot)
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2      // blocks per SM the registers must allow (__launch_bounds__)
#endif
#define TILE 32
#define D 128
#define ROWS ((G) > 8 ? 2 : 1)
#define PSCALE 32768.0f
#define LN2 0.6931471805599453f
#define NEG_INF __int_as_float(0xff800000)

#include "fp8_ops.cuh"

extern "C" __global__ void __launch_bounds__(NW * 32, MIN_BLOCKS)
cpattn_fp8_decode(const u16* __restrict__ q, const u8* __restrict__ k_cache, const u8* __restrict__ v_cache,
                  const bt_t* __restrict__ block_table, const int* __restrict__ tok_idx,
                  const int* __restrict__ req_idx,
                  const int* __restrict__ kv_lens, const float* __restrict__ k_scales,
                  const float* __restrict__ v_scales, void* __restrict__ out, float* __restrict__ lse,
                  int stride_qt, int stride_qh, int stride_kb, int stride_ks, int stride_kh, int stride_vb,
                  int stride_vs, int stride_vh, int stride_btb, int stride_sp, int scale_div, int log2_ps,
                  int stride_os, int stride_ot, int stride_oh, int stride_ls, int stride_lt, int direct,
                  double scale_log2_d) {
  extern __shared__ __align__(16) u8 smem[];   // NW rings of STAGES x STAGE_BYTES, then the merge's rows
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#if HPB   // warp w: kv head NW y + w over the whole split
  const int i = blockIdx.x, kh = blockIdx.y * NW + warp, s = blockIdx.z, splits = gridDim.z, align = TILE;
#else     // the warps: the kv head's tiles in turn
  const int i = blockIdx.x, kh = blockIdx.y, s = blockIdx.z, splits = gridDim.z, align = NW * TILE;
#endif
  const float scale_log2 = (float)scale_log2_d;
  const int tok = tok_idx[i], req = req_idx[i], kv_len = kv_lens[i];
  const int ps_mask = (1 << log2_ps) - 1;
  const int per_split = (kv_len + splits - 1) / splits;
  const int chunk = (per_split + align - 1) / align * align;
  const int start = s * chunk;
  const int end = min(start + chunk, kv_len);
  const bt_t* bt = block_table + (long long)req * stride_btb;

  // q: rows g (and g + 8 when G > 8) of the A operand; hi and lo e4m3 parts per register of q_dim's columns
  u32 qa_hi[ROWS][8], qa_lo[ROWS][8];
  float qs[ROWS];
  const u16* q_base = q + (long long)tok * stride_qt + (long long)kh * G * stride_qh;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    int head = g + 8 * r;
    quantize_q(q_base + (long long)(head < G ? head : 0) * stride_qh, head, t, qa_hi[r], qa_lo[r], &qs[r]);
  }
  float acc[ROWS][8][4];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int n = 0; n < 8; ++n) acc[r][n][0] = acc[r][n][1] = acc[r][n][2] = acc[r][n][3] = 0.0f;
  float m_run[ROWS], l_run[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) { m_run[r] = NEG_INF; l_run[r] = 0.0f; }
  float v_ref = 0.0f;   // the largest V scale of the pages seen (warp-uniform)

  // The key loop, STAGES tiles deep: each lane copies its own K and V chunks (16 x 16 bytes a tile) and lanes 0-7
  // the tile's 8 scales into the warp's ring in shared memory by cp.async (no registers held while in flight), and
  // reads back only what it copied (plus the scales, after __syncwarp). A tile's page ids are loaded one tile earlier
  // so its copies issue without waiting on the block table.
  u8* ring = smem + warp * (STAGES * STAGE_BYTES);
#if HPB
  const int step = TILE, first = start;
#else
  const int step = NW * TILE, first = start + warp * TILE;
#endif
  int tile_issue = first;
  int pages_next[4];
  load_pages(bt, tile_issue, end, log2_ps, pages_next);
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    issue_tile(ring + k * STAGE_BYTES, k_cache, v_cache, k_scales, v_scales, pages_next, tile_issue, end, kh, g, t,
               lane, ps_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_sp, scale_div);
    tile_issue += step;
    load_pages(bt, tile_issue, end, log2_ps, pages_next);
  }
  int stage = 0;
  for (int tile = first; tile < end; tile += step) {
    __syncwarp();   // every lane read the stage about to be refilled (its scales)
    issue_tile(ring + ((stage + STAGES - 1) % STAGES) * STAGE_BYTES, k_cache, v_cache, k_scales, v_scales,
               pages_next, tile_issue, end, kh, g, t, lane, ps_mask, stride_kb, stride_ks, stride_kh, stride_vb,
               stride_vs, stride_vh, stride_sp, scale_div);
    tile_issue += step;
    load_pages(bt, tile_issue, end, log2_ps, pages_next);
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1));
    __syncwarp();
    const u8* here = ring + stage * STAGE_BYTES;
    stage = (stage + 1) % STAGES;
    u32x4 kr[4][2], vr[2][2][2];
#pragma unroll
    for (int c = 0; c < 8; ++c) kr[c / 2][c % 2] = *reinterpret_cast<const u32x4*>(here + c * 512 + lane * 16);
#pragma unroll
    for (int c = 0; c < 8; ++c)
      vr[c / 4][(c / 2) % 2][c % 2] = *reinterpret_cast<const u32x4*>(here + (8 + c) * 512 + v_slot(g, t));
    float ks[4], vs[4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      ks[nt] = reinterpret_cast<const float*>(here + 16 * 512)[nt];
      vs[nt] = reinterpret_cast<const float*>(here + 16 * 512)[4 + nt];
    }
    // S = q.K (log2 units)
    float sc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        u32 b0 = word(kr[nt][(2 * kk) / 4], (2 * kk) % 4), b1 = word(kr[nt][(2 * kk + 1) / 4], (2 * kk + 1) % 4);
        u32 a1h = ROWS > 1 ? qa_hi[ROWS - 1][2 * kk] : 0u, a3h = ROWS > 1 ? qa_hi[ROWS - 1][2 * kk + 1] : 0u;
        u32 a1l = ROWS > 1 ? qa_lo[ROWS - 1][2 * kk] : 0u, a3l = ROWS > 1 ? qa_lo[ROWS - 1][2 * kk + 1] : 0u;
        mma_e4m3(sc[nt], qa_hi[0][2 * kk], a1h, qa_hi[0][2 * kk + 1], a3h, b0, b1);
        mma_e4m3(sc[nt], qa_lo[0][2 * kk], a1l, qa_lo[0][2 * kk + 1], a3l, b0, b1);
      }
    }
    // Online softmax per row (heads g, g + 8): the row's keys are spread over the quad (t)
    float v_top = fmaxf(fmaxf(vs[0], vs[1]), fmaxf(vs[2], vs[3]));
    float v_new = fmaxf(v_ref, v_top);
    float v_fac = v_new > 0.0f ? v_ref / v_new : 1.0f;
    float v_inv = v_new > 0.0f ? PSCALE / v_new : 0.0f;
    float alpha[2] = {1.0f, 1.0f};
    u32 pa[2][2][2];   // [k-step j][row r][n-tile 2 j + h] f16x2
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float rs = qs[r] * scale_log2, tmax = NEG_INF;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = sc[nt][2 * r + e] * ks[nt] * rs;
          x = (tile + 8 * nt + 2 * t + e) < end ? x : NEG_INF;
          sc[nt][2 * r + e] = x;
          tmax = fmaxf(tmax, x);
        }
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
      tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
      float m_new = fmaxf(m_run[r], tmax);
      float m_safe = m_new == NEG_INF ? 0.0f : m_new;
      alpha[r] = exp2f(m_run[r] - m_safe);
      float sum = 0.0f, p[4][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          p[nt][e] = exp2f(sc[nt][2 * r + e] - m_safe);
          sum += p[nt][e];
        }
      l_run[r] = l_run[r] * alpha[r] + sum;
      m_run[r] = m_new;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          int nt = 2 * j + h;
          float w = vs[nt] * v_inv;
          pa[j][r][h] = f16x2_of(p[nt][1] * w, p[nt][0] * w);
        }
    }
    v_ref = v_new;
    // O^T += V^T P^T: k-step j holds keys 16 j .. 16 j + 15; m-tile mt's rows g, g + 8 are thread g's dims 16 g + 2 mt
    // and + 1 (bytes 2 mt, 2 mt + 1 of its load); P^T's B operand is the q.K accumulators' P as they lie; the
    // columns are heads 8 r + 2 t, + 1, whose alphas come from those heads' quads
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float a_even = __shfl_sync(0xffffffffu, alpha[r], 8 * t) * v_fac;
      float a_odd = __shfl_sync(0xffffffffu, alpha[r], 8 * t + 4) * v_fac;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        acc[r][n][0] *= a_even; acc[r][n][1] *= a_odd; acc[r][n][2] *= a_even; acc[r][n][3] *= a_odd;
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        u32 lo0 = __byte_perm(word(vr[j][0][0], m), word(vr[j][0][1], m), 0x5140);
        u32 hi0 = __byte_perm(word(vr[j][0][0], m), word(vr[j][0][1], m), 0x7362);
        u32 lo1 = __byte_perm(word(vr[j][1][0], m), word(vr[j][1][1], m), 0x5140);
        u32 hi1 = __byte_perm(word(vr[j][1][0], m), word(vr[j][1][1], m), 0x7362);
#pragma unroll
        for (int odd = 0; odd < 2; ++odd) {
          u32 x0 = odd ? hi0 : lo0, x1 = odd ? hi1 : lo1;
          u32 a0 = f16x2_of_e4m3x2((u16)(x0 & 0xffffu)), a1 = f16x2_of_e4m3x2((u16)(x0 >> 16));
          u32 a2 = f16x2_of_e4m3x2((u16)(x1 & 0xffffu)), a3 = f16x2_of_e4m3x2((u16)(x1 >> 16));
#pragma unroll
          for (int r = 0; r < ROWS; ++r) mma_f16(acc[r][2 * m + odd], a0, a1, a2, a3, pa[j][r][0], pa[j][r][1]);
        }
      }
  }

  // The warp's rows: l summed over the quad; unnormalised outputs (V scales applied) to shared memory (the rings'
  // bytes: every copy landed, every warp is past its loop)
  asm volatile("cp.async.wait_group 0;");
  __syncthreads();
  float (*sm_o)[G][D] = reinterpret_cast<float (*)[G][D]>(smem);
  float (*sm_m)[G] = reinterpret_cast<float (*)[G]>(smem + NW * G * D * 4);
  float (*sm_l)[G] = reinterpret_cast<float (*)[G]>(smem + NW * G * D * 4 + NW * G * 4);
  float o_fac = v_ref / PSCALE;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
    int head = g + 8 * r;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        int col = 8 * r + 2 * t + (c & 1);
        if (col < G) sm_o[warp][col][16 * g + 2 * n + (c >> 1)] = acc[r][n][c] * o_fac;
      }
    if (head < G) {
      if (t == 0) { sm_m[warp][head] = m_run[r]; sm_l[warp][head] = l_run[r]; }
    }
  }
  __syncthreads();
  // The block's warps merged by their maxima (HPB: each warp's own rows); one row per (head, dim)
  const long long row = direct ? (long long)tok : (long long)i;
#if HPB
  for (int idx = threadIdx.x; idx < NW * G * D; idx += NW * 32) {
    const int w0 = idx / (G * D), w1 = w0 + 1, head = idx % (G * D) / D, dim = idx % D;
#else
  for (int idx = threadIdx.x; idx < G * D; idx += NW * 32) {
    const int w0 = 0, w1 = NW, head = idx / D, dim = idx % D;
#endif
    float mx = NEG_INF;
#pragma unroll
    for (int w = w0; w < w1; ++w) mx = fmaxf(mx, sm_m[w][head]);
    float l = 0.0f, o = 0.0f;
    if (mx != NEG_INF) {
#pragma unroll
      for (int w = w0; w < w1; ++w) {
        float f = exp2f(sm_m[w][head] - mx);
        l += sm_l[w][head] * f;
        o += sm_o[w][head][dim] * f;
      }
    }
    bool has_keys = l > 0.0f;
    float val = has_keys ? o / l : 0.0f;
#if HPB
    long long q_head = (long long)(blockIdx.y * NW + w0) * G + head;
#else
    long long q_head = (long long)kh * G + head;
#endif
    long long at = (long long)(direct ? 0 : s) * stride_os + row * stride_ot + q_head * stride_oh + dim;
#if OUT_KIND == 0
    reinterpret_cast<float*>(out)[at] = val;
#elif OUT_KIND == 1
    u32 bits = __float_as_uint(val);
    bits += 0x7fffu + ((bits >> 16) & 1u);   // round to nearest even (outputs are finite)
    reinterpret_cast<u16*>(out)[at] = (u16)(bits >> 16);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(val));
    reinterpret_cast<u16*>(out)[at] = h;
#endif
    if (dim == 0)
      lse[(long long)(direct ? 0 : s) * stride_ls + row * stride_lt + q_head] =
          has_keys ? (mx + __log2f(l)) * LN2 : NEG_INF;
  }
}
