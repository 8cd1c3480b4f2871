// The fp8 decode's device helpers (fp8_decode.cu includes this after its defines): PTX conversions and mma, cp.async
// copies, the query's e4m3 split and one tile's copies into a warp's ring.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#ifndef BT64       // the block table's entries: int32, or int64 with -DBT64
typedef int bt_t;
#else
typedef long long bt_t;
#endif

struct __align__(16) u32x4 { u32 x, y, z, w; };

__device__ __forceinline__ float q_to_float(u16 h) {
#if Q_KIND == 1
  return __uint_as_float(((u32)h) << 16);
#else
  float f;
  asm("{ .reg .b16 r; mov.b16 r, %1; cvt.f32.f16 %0, r; }" : "=f"(f) : "h"(h));
  return f;
#endif
}

__device__ __forceinline__ u16 e4m3x2_of(float hi, float lo) {   // lo in the low byte
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 f16x2_of_e4m3x2(u16 x) {   // the low byte to the low half
  u32 r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
  return r;
}

__device__ __forceinline__ u32 f16x2_of(float hi, float lo) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float f16_lo(u32 x) {
  float f;
  asm("{ .reg .b16 a, b; mov.b32 {a, b}, %1; cvt.f32.f16 %0, a; }" : "=f"(f) : "r"(x));
  return f;
}

__device__ __forceinline__ float f16_hi(u32 x) {
  float f;
  asm("{ .reg .b16 a, b; mov.b32 {a, b}, %1; cvt.f32.f16 %0, b; }" : "=f"(f) : "r"(x));
  return f;
}

__device__ __forceinline__ void mma_e4m3(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The page slot of key tile + 8 nt (tiles start on 8 keys, pages hold a multiple of 8)
__device__ __forceinline__ int key0_slot(int tile, int nt, int ps_mask) { return (tile + nt * 8) & ps_mask; }

__device__ __forceinline__ u32 word(const u32x4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// Thread t's q columns: register j < 4 holds dims 16 t + 4 j .. + 3, j >= 4 dims 64 + 16 t + 4 (j - 4) .. + 3 (its two
// 16-byte loads of each key); k-step kk of the q.K mma takes registers 2 kk (columns 4 t ..) and 2 kk + 1
// (16 + 4 t ..).
__device__ __forceinline__ int q_dim(int t, int j) { return (j < 4 ? 16 * t + 4 * j : 64 + 16 * t + 4 * (j - 4)); }

// q [G heads] of this kv head as e4m3 hi + lo of q / qs (qs: the head's largest |q| over 256), per row, per register.
__device__ __forceinline__ void quantize_q(const u16* q_row, int head, int t, u32* hi, u32* lo, float* qs_out) {
  float x[32];
  float amax = 0.0f;
  bool real = head < G;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[4 * j + i] = real ? q_to_float(q_row[q_dim(t, j) + i]) : 0.0f;
      amax = fmaxf(amax, fabsf(x[4 * j + i]));
    }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  float qs = amax > 0.0f ? amax * (1.0f / 256.0f) : 1.0f;
  float inv = 1.0f / qs;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float v[4], r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = x[4 * j + i] * inv;
    u32 h = (u32)e4m3x2_of(v[1], v[0]) | ((u32)e4m3x2_of(v[3], v[2]) << 16);
    u32 h01 = f16x2_of_e4m3x2((u16)(h & 0xffffu)), h23 = f16x2_of_e4m3x2((u16)(h >> 16));
    r[0] = v[0] - f16_lo(h01); r[1] = v[1] - f16_hi(h01); r[2] = v[2] - f16_lo(h23); r[3] = v[3] - f16_hi(h23);
    hi[j] = h;
    lo[j] = (u32)e4m3x2_of(r[1], r[0]) | ((u32)e4m3x2_of(r[3], r[2]) << 16);
  }
  *qs_out = qs;
}


__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void copy16(u8* dst, const u8* src, bool ok) {   // zeros where not ok
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void copy4(u8* dst, const float* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 4 : 0));
}

// The page of each run of 8 keys of the tile at ``tile`` (0 past the split's end: never read)
__device__ __forceinline__ void load_pages(const bt_t* bt, int tile, int end, int log2_ps, int* pages) {
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    int key0 = tile + nt * 8;
    pages[nt] = key0 < end ? (int)bt[key0 >> log2_ps] : 0;
  }
}

// Where thread (g, t)'s 16 bytes of a V chunk (key 2 t + e of its 8, bytes 16 g ..) sit in the chunk's 512 bytes.
// VSWZ 0: lane-major (4 g + t). Then the two 16-byte halves of a 32-byte sector are copied by lanes g, g + 1 into
// slots 64 bytes apart, and cp.async moves each half as a sector of its own (ncu on the H200: V's 8 copies 2x their
// sectors, 34% of all the kernel's, L2 89% busy at 57% of DRAM bandwidth). VSWZ 1: key-major (key t's 128 bytes at
// 128 t), its 16-byte units XOR-swizzled by 2 t, so a sector's halves stay adjacent and the 8 lanes of each
// quarter-warp read back 8 distinct 16-byte bank groups.
__device__ __forceinline__ int v_slot(int g, int t) {
  return VSWZ ? 128 * t + 16 * (g ^ (2 * t)) : 16 * (4 * g + t);
}

// One tile's copies into a stage: chunks 0-7 this lane's K (key tile + 8 nt + g, bytes 16 t .. and 64 + 16 t ..),
// chunks 8-15 its V (keys 16 j + 8 h + 2 t + e, bytes 16 g ..), each chunk 32 lanes x 16 bytes; then the 4 K and 4
// V scales of the tile's runs (lanes 0-7). A commit group per tile, empty past the end.
__device__ __forceinline__ void issue_tile(u8* st, const u8* k_cache, const u8* v_cache, const float* k_scales,
                                           const float* v_scales, const int* pages, int tile, int end, int kh, int g,
                                           int t, int lane, int ps_mask, int stride_kb, int stride_ks, int stride_kh,
                                           int stride_vb, int stride_vs, int stride_vh, int stride_sp, int scale_div) {
  if (tile < end) {
    // Copy i of K and of V takes 4 whole keys (lanes 8 apart: 128 contiguous bytes each) and puts each 16 bytes where
    // the lane reading them back expects them: K's key g bytes 16 t (+ 64: chunk 2 nt + 1) in lane 4 g + t's slot of
    // chunk 2 nt; V's key 2 t + e bytes 16 g at v_slot(g, t) of chunk 8 + 4 (nt / 2) + 2 (nt % 2) + e. (Measured on
    // the H200 with the scales' page chain below: 1M keys 0.786 -> 0.770 ms; the copies' sectors did not change.)
    const int kw = lane / 8, kb = 16 * (lane % 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      int nt = i / 2, w = 4 * (i % 2) + kw, slot = key0_slot(tile, nt, ps_mask) + w;
      bool ok = tile + nt * 8 + w < end;
      const u8* pk = k_cache + (long long)pages[nt] * stride_kb + (long long)slot * stride_ks
                     + (long long)kh * stride_kh;
      copy16(st + (2 * nt + kb / 64) * 512 + (4 * w + kb % 64 / 16) * 16, pk + kb, ok);
      const u8* pv = v_cache + (long long)pages[nt] * stride_vb + (long long)slot * stride_vs
                     + (long long)kh * stride_vh;
      copy16(st + (8 + 4 * (nt / 2) + 2 * (nt % 2) + w % 2) * 512 + v_slot(kb / 16, w / 2), pv + kb, ok);
    }
    if (lane < 8) {
      int nt = lane % 4;   // pages[] by a chain, not by index: a lane-dependent index puts the array in local memory
      int page = nt == 0 ? pages[0] : nt == 1 ? pages[1] : nt == 2 ? pages[2] : pages[3];
      long long sp = (long long)(page / scale_div) * stride_sp + kh;
      copy4(st + 16 * 512 + 4 * lane, (lane < 4 ? k_scales : v_scales) + sp, tile + nt * 8 < end);
    }
  }
  asm volatile("cp.async.commit_group;");
}
