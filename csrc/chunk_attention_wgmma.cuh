// Paged attention for prompt chunks on Hopper's warpgroup tensor cores (wgmma, sm_90a),
// head_dim 128: the semantics, layouts, block numbering, split-K and combine of
// chunk_attention.cuh, whose pieces (chunk_place, the softmax phases, chunk_finish) it
// shares.
//
// The mma.sync kernel loses to Triton where few sequences carry a short chunk over a long
// cached prefix (a prefix-cache hit: 78 tokens over 992 cached), because each warp issues
// a tile's 128 mma.sync, its ldmatrix and its softmax one after another with nothing to
// fill the waits (docs/BENCHMARKS.md). Here a block has two warpgroups (128 query rows, 64
// each) and the products are warpgroup-wide and asynchronous:
//
//   S = Q K^T   wgmma m64n64k16 x 8 (head_dim 128): A = Q in registers (each warp's 16 rows
//               as mma.sync A fragments, loaded once by ldmatrix), B = the key tile in
//               shared memory, K-major (a key's 128 dims are two 128-byte rows, one per
//               half of the dims), 128-byte swizzle
//   P           chunk_softmax_max / _exp on S's accumulators, which have mma.sync's layout
//               per warp, packed into A fragments in registers
//   O += P V    wgmma m64n64k16 x 8 (64 keys x two halves of the dims): A = P, B = the
//               value tile, N-major (transposed: a key's dims are contiguous), the same
//               swizzled layout as the keys
//
// The S of the next tile is issued after this one's row maxima and before its
// exponentials, so the tensor cores work while the warps compute them. With two warps a
// scheduler the kernel is bound by its warps' instruction streams (docs/BENCHMARKS.md),
// so a tile does no more than it must: the causal mask only in tiles that reach a row's own
// position (a second copy of the loop runs the others), the output's rescaling only where
// a row's running max moved, and the max moves only when a tile's exceeds it by more than
// kCwSlack. Keys come in tiles of 64 through a ring of
// kCwStages tiles that every thread fills with cp.async (its 16-byte pieces written at
// their swizzled places); a tile's stage is refilled once every warpgroup's products of it
// have completed. The block ids of a refill are read one iteration before its copies.
// Every warpgroup computes every tile of the block's key range, and no branch is taken
// while a wgmma is in flight (the compiler would then wait for each as it is issued): a
// block whose rows fit one warpgroup still runs two.
//
// The 128-byte swizzle: 16-byte piece j of a 128-byte row r sits at piece j ^ (r % 8);
// groups of 8 rows are 1024 bytes apart and 1024-byte aligned.
#pragma once

#include <type_traits>

#include "chunk_attention.cuh"
#include "quant_wgmma.cuh"

namespace asyncgen {

constexpr int kCwWarps = 8;                        // two warpgroups
constexpr int kCwThreads = kCwWarps * kWarpSize;
constexpr int kCwRows = 128;                       // query rows a block: 64 a warpgroup
constexpr int kCwKeys = 64;                        // keys a tile
constexpr int kCwHeadDim = 128;
#ifndef AG_CW_STAGES
#define AG_CW_STAGES 4
#endif
constexpr int kCwStages = AG_CW_STAGES;
// A row's running max moves only when a tile's max exceeds it by more than this (base 2),
// so that the output is rescaled rarely; P stays below 2^kCwSlack, exact in fp16 and bf16.
constexpr float kCwSlack = 8.f;
static_assert(kCwStages >= 2, "a tile in flight beside the one computed");
constexpr int kCwHalfBytes = kCwKeys * 128;        // 64 keys x 64 dims x 2 bytes
constexpr int kCwTileBytes = 4 * kCwHalfBytes;     // K's two halves of the dims, then V's
constexpr int kCwQRow = kCwHeadDim + kChunkPad;    // Q staged in padded rows for ldmatrix
constexpr int kCwSmemBytes = kCwStages * kCwTileBytes + kCwRows * kCwQRow * 2 + 1024;  // + ring alignment
static_assert(kCwSmemBytes <= 227 * 1024, "one block an SM");

template <typename T>
__global__ void __launch_bounds__(kCwThreads, 1) chunk_attention_wgmma_kernel(const ChunkAttentionParams p) {
  constexpr int HEAD_DIM = kCwHeadDim;
  constexpr int kPieces = HEAD_DIM / 8;                     // 16-byte pieces of a key row
  constexpr int kLoads = kCwKeys * kPieces / kCwThreads;    // key rows a thread copies a tile
  constexpr int kRowStep = kCwThreads / kPieces;
  static_assert(kRowStep % 8 == 0, "a thread's rows share their swizzle phase");
  constexpr int kAhead = kCwStages - 1;                     // tiles requested beyond the one computed
  AG_DYNAMIC_SMEM(smem_raw);
  unsigned char* ring = smem_raw + (1024 - smem_address(smem_raw) % 1024) % 1024;
  T* q_s = reinterpret_cast<T*>(ring + kCwStages * kCwTileBytes);  // [kCwRows][kCwQRow]
  __shared__ float scratch[kCwWarps];

  const int group = p.num_heads / p.num_kv_heads;
  const int pid = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const ChunkPlace at = chunk_place<kCwWarps, kCwRows, kCwKeys>(p, group, pid, split, scratch);
  if (!at.valid) return;  // uniform over the block
  const int rows = at.rows, first_pos = at.first_pos, kv_end = at.kv_end;
  const int tile_lo = at.tile_lo, tile_hi = at.tile_hi;

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4;
  const int row0 = 16 * warp;                // the warp's rows of the block
  const int warp_first_pos = first_pos + row0 / group;
  int pos_lo = first_pos + (row0 + g) / group;
  int pos_hi = first_pos + (row0 + g + 8) / group;
  opaque(pos_lo);  // kept in a register: recomputing the divisions in every tile's mask cost more
  opaque(pos_hi);

  const T* q = static_cast<const T*>(p.q);
  const ChunkKV<T, HEAD_DIM> kv(p, at, kv_head);

  // Thread t copies piece t % 16 of key rows t / 16 + 16 u of each tile (K and V). A tile
  // starts on a cache block boundary (block_size <= 64, both powers of two), so a row keeps
  // its slot in the block from tile to tile; all of a thread's rows have the swizzle phase
  // of the first.
  const int piece = threadIdx.x % kPieces, j0 = threadIdx.x / kPieces;
  const int dst0 = (piece / 8) * kCwHalfBytes + j0 * 128 + 16 * ((piece % 8) ^ (j0 % 8));
  int slot_off[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    slot_off[u] = ((j0 + u * kRowStep) & ((1 << p.block_shift) - 1)) * static_cast<int>(kv.token_stride) + piece * 8;
  }
  auto fetch_ids = [&](int (&ids)[kLoads], int tile) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int pos = tile * kCwKeys + j0 + u * kRowStep;
      ids[u] = tile < tile_hi && pos < kv_end ? kv.table[pos >> p.block_shift] : 0;
    }
  };
  auto load_tile = [&](const int (&ids)[kLoads], int tile, int stage) {
    unsigned char* dst = ring + stage * kCwTileBytes + dst0;
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const bool ok = tile * kCwKeys + j0 + u * kRowStep < kv_end;
      const int64_t block = ok ? ids[u] : 0;
      cp_async16(dst + u * kRowStep * 128, kv.k + block * p.k_stride_block + slot_off[u], ok);
      cp_async16(dst + 2 * kCwHalfBytes + u * kRowStep * 128, kv.v + block * p.v_stride_block + slot_off[u], ok);
    }
  };

  float o[2][32];  // [half of the dims][4 i + 2 h + e]: row g + 8 h, dim 64 half + 8 i + 2 c + e
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int r = 0; r < 32; ++r) o[h][r] = 0.f;
  ChunkRows st;

  if (tile_lo < tile_hi) {
    // Q (commit group 0), then the first kAhead tiles (groups 1 .. kAhead), their block ids
    // read together first.
    for (int i = threadIdx.x; i < kCwRows * kPieces; i += kCwThreads) {
      const int r = i / kPieces, pc = i % kPieces;
      const bool ok = r < rows;
      const int64_t token = at.q_start + at.q_tile * at.tq + (ok ? r / group : 0);
      const int head = kv_head * group + (ok ? r % group : 0);
      cp_async16(q_s + r * kCwQRow + pc * 8, q + token * p.q_stride_token + head * p.q_stride_head + pc * 8, ok);
    }
    cp_async_commit();
    {
      int first_ids[kAhead][kLoads];
#pragma unroll
      for (int s = 0; s < kAhead; ++s) fetch_ids(first_ids[s], tile_lo + s);
#pragma unroll
      for (int s = 0; s < kAhead; ++s) {
        if (tile_lo + s < tile_hi) load_tile(first_ids[s], tile_lo + s, s);
        cp_async_commit();
      }
    }
    int next_ids[kLoads];
    fetch_ids(next_ids, tile_lo + kAhead);

    uint32_t qa[HEAD_DIM / 16][4];
    const uint32_t ring_base = smem_address(ring);
    // S of the tile in `stage` into s, issued and committed, not waited for.
    const auto issue_s = [&](float (&s)[32], int stage) {
      // A descriptor's address field is the byte address / 16 (14 bits; shared memory
      // stays below 2^18 bytes), so later addresses of the tile add to the first's.
      const uint64_t k_desc = wgmma_desc_k128(ring_base + stage * kCwTileBytes);
#pragma unroll
      for (int r = 0; r < 32; ++r) s[r] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        wgmma64<T, 0>(s, qa[kk], k_desc + (((kk / 4) * kCwHalfBytes + 32 * (kk % 4)) >> 4));
      }
      wgmma_commit();
    };
    // Tile `i` of the range, its S complete: the softmax's max phase, the output rescaled
    // only where a row's max rose (by more than kCwSlack, so rarely after the first tiles,
    // and before the next product is in flight: a branch with a product in flight makes
    // the compiler wait for each one as it is issued), then `next()` (the next tile's S),
    // the exponentials beside it, and O += P V issued and committed. `mask` false (a
    // std::integral_constant) leaves out the causal mask: for tiles every row sees whole.
    const auto softmax_pv = [&](auto mask, float (&s)[32], int i, auto&& next) {
      const int tile = tile_lo + i, stage = i % kCwStages;
#pragma unroll
      for (int r = 0; r < 32; ++r) fence_register(s[r]);
      const auto s_at = [&](int nt, int r) -> float& { return s[4 * nt + r]; };
      float base_lo, base_hi, alpha_lo, alpha_hi;
      chunk_softmax_max<kCwKeys / 8>(s_at, tile * kCwKeys,
                                     decltype(mask)::value && (tile + 1) * kCwKeys - 1 > warp_first_pos, pos_lo,
                                     pos_hi, p.scale_log2, kCwSlack, st, base_lo, base_hi, alpha_lo, alpha_hi);
      if (__any_sync(kFullMask, alpha_lo != 1.f || alpha_hi != 1.f)) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int n = 0; n < 8; ++n) {
            o[h][4 * n] *= alpha_lo;
            o[h][4 * n + 1] *= alpha_lo;
            o[h][4 * n + 2] *= alpha_hi;
            o[h][4 * n + 3] *= alpha_hi;
          }
      }
      next();
      chunk_softmax_exp<kCwKeys / 8>(s_at, base_lo, base_hi, alpha_lo, alpha_hi, st);
      // P's accumulator tiles 2j, 2j + 1 are the A fragment of keys 16j .. 16j + 15.
      uint32_t pa[kCwKeys / 16][4];
#pragma unroll
      for (int j = 0; j < kCwKeys / 16; ++j) {
        pa[j][0] = pack2<T>(s[8 * j], s[8 * j + 1]);
        pa[j][1] = pack2<T>(s[8 * j + 2], s[8 * j + 3]);
        pa[j][2] = pack2<T>(s[8 * j + 4], s[8 * j + 5]);
        pa[j][3] = pack2<T>(s[8 * j + 6], s[8 * j + 7]);
      }
      const uint64_t v_desc = wgmma_desc_mn128(ring_base + stage * kCwTileBytes + 2 * kCwHalfBytes);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < kCwKeys / 16; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wgmma64<T, 1>(o[h], pa[j], v_desc + ((h * kCwHalfBytes + 16 * j * 128) >> 4));
        }
      wgmma_commit();
    };
    const auto wait_all = [&] {
      wgmma_wait<0>();
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int r = 0; r < 32; ++r) fence_register(o[h][r]);
    };
    // Tile i's stage is refilled with tile i + kCwStages at iteration i + 1, once every
    // warp has waited for its products (the barrier there).
    const auto refill = [&](int i) {
      const int tile = tile_lo + i;
      if (tile + kAhead < tile_hi) load_tile(next_ids, tile + kAhead, (i + kAhead) % kCwStages);
      cp_async_commit();
      fetch_ids(next_ids, tile + kAhead + 1);
    };
    const auto load_q = [&] {
      const int mi = lane / 8, ri = lane % 8;
#pragma unroll
      for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        ldmatrix_x4<false>(qa[kk], q_s + (row0 + (mi % 2) * 8 + ri) * kCwQRow + 16 * kk + (mi / 2) * 8);
      }
    };
    // S of tile i + 1 is issued in the softmax of tile i and runs beside its exponentials.
    // Tile i + 1 is waited for at iteration i: commit group i + 2 of kAhead + 1 + i. Every
    // warpgroup computes every tile of the block's range (rows past the block's are
    // computed and not written; keys past a row's are masked in the masked tiles).
    static_assert(kAhead >= 2, "a tile in flight beyond the next");
    const int n = tile_hi - tile_lo;
    {  // Q (rows past the block's are zeros) and tile 0
      float s0[32], s1[32];
      cp_async_wait<kAhead - 1>();
      fence_proxy_async();
      __syncthreads();
      load_q();
      issue_s(s0, 0);
      wgmma_wait<0>();
      const auto step = [&](auto mask, int i, float (&s_now)[32], float (&s_next)[32]) {
        cp_async_wait<kAhead - 2>();
        fence_proxy_async();
        __syncthreads();  // tile i + 1 is in; every warp is done with tile i - 1
        refill(i);
        softmax_pv(mask, s_now, i, [&] { issue_s(s_next, (i + 1) % kCwStages); });
        wait_all();  // P V of tile i and S of tile i + 1
      };
      const std::integral_constant<bool, false> whole;
      const std::integral_constant<bool, true> masked;
      // Tiles before plain_end end at or before the block's first position: no row of any
      // warp needs the mask there.
      const int plain_end = (first_pos + 1) / kCwKeys;
      int i = 0;
      for (; i + 2 < n && tile_lo + i + 1 < plain_end; i += 2) {
        step(whole, i, s0, s1);
        step(whole, i + 1, s1, s0);
      }
      for (; i + 2 < n; i += 2) {
        step(masked, i, s0, s1);
        step(masked, i + 1, s1, s0);
      }
      if (i + 1 < n) {
        step(masked, i, s0, s1);
        softmax_pv(masked, s1, i + 1, [] {});
      } else {
        softmax_pv(masked, s0, i, [] {});
      }
      wait_all();
    }
  }
  chunk_finish<T, HEAD_DIM, kCwThreads, kCwRows>(
      p, at, kv_head, split, pid, row0, [&](int t, int r) -> float& { return o[t / 8][4 * (t % 8) + r]; }, st);
}

// Whether the warpgroup kernel takes these shapes: a build with it (kWgmmaBuilt; the
// caller checks the device is sm_90), head_dim 128, the group and split limits of the
// mma.sync kernel, cache blocks of at most 64 keys.
inline bool chunk_attention_wgmma_supported(int head_dim, int group, int num_splits, int block_shift) {
  return kWgmmaBuilt && head_dim == kCwHeadDim && chunk_attention_supported(head_dim, group, num_splits) &&
         block_shift >= 0 && (1 << block_shift) <= kCwKeys;
}

// Returns false when the kernel does not take the shapes.
template <typename T>
bool launch_chunk_attention_wgmma(const ChunkAttentionParams& p, int head_dim, cudaStream_t stream) {
  const int group = p.num_kv_heads > 0 ? p.num_heads / p.num_kv_heads : 0;
  if (!chunk_attention_wgmma_supported(head_dim, group, p.num_splits, p.block_shift)) return false;
  if (p.num_tokens == 0 || p.num_seqs == 0) return true;
  void (*kernel)(const ChunkAttentionParams) = chunk_attention_wgmma_kernel<T>;
  allow_dynamic_smem<chunk_attention_wgmma_kernel<T>>(kCwSmemBytes);
  const dim3 grid(chunk_grid_x(p.num_tokens, p.num_seqs, group, kCwRows), p.num_kv_heads, p.num_splits);
  AG_LAUNCH_KERNEL(kernel, grid, dim3(kCwThreads), kCwSmemBytes, stream, p);
  return true;
}

}  // namespace asyncgen
