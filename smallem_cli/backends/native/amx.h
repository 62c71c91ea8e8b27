// The same integer products as `qtile` (qmatmul.h), on AMX's tile unit, for passes of several rows.
//
// Why: a pass over T tokens costs one read of the weights plus T rows of products, and with 16-bit
// inputs the registers' products (two vpdpwssd per row per 4 x 16 weights) dominate a pass of many
// rows (docs/architecture.md, "The native backend"). One tile product takes 16 rows x 16 outputs x 32 weights.
//
// The tile unit multiplies bytes, so each input is split as xq = 256 hi + lo, hi and lo signed bytes
// (|xq| <= XQ_MAX), and a row's hi and lo are two rows of the tile: dot = 256 sum(u hi) + sum(u lo),
// each sum exact in int32, so dot_b is the very integer `qtile` sums, and every float operation after
// it is `qtile`'s, in the same order: the outputs are the same bits whichever path a pass takes.
//
// A block's weights are a B tile as the panels lay them out: QB/4 rows of PANEL outputs x 4 bytes
// (nibbles spread to bytes first). A tile product's cost hardly depends on its rows, so a product of
// fewer than AMX_ROWS rows stays on the registers; each block's sums go through memory to the float
// epilogue, a chunk of blocks at a time, so that no load waits on the store just before it.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && PANEL == 16
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AMX_ROWS
#define AMX_ROWS 5  // the fewest rows a product takes to the tile unit
#endif
#define AMX_CHUNK 4  // blocks a tile row group takes in turn, their sums stored, then their epilogues
#define AMX_NV 4     // panels a block's inputs meet: sums in tiles 4-7

struct TileConfig {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0 and 3: the inputs (2m rows of QB bytes, one block after another); 1, 2: weights (QB/4 rows
// of 64 bytes); 4-7: the sums (2m rows of 16 int32). The configuration is the thread's, whoever loaded it
// (another library in this process may have), so it is read back and loaded only where it differs.
static inline void amx_configure(int m, int QB) {
    alignas(64) TileConfig want{}, have;
    want.palette = 1;
    for (int t : {0, 3}) want.rows[t] = (uint8_t)(2 * m), want.colsb[t] = (uint16_t)QB;
    for (int t : {1, 2}) want.rows[t] = (uint8_t)(QB / 4), want.colsb[t] = 64;
    for (int t = 4; t < 8; t++) want.rows[t] = (uint8_t)(2 * m), want.colsb[t] = 64;
    _tile_storeconfig(&have);
    if (memcmp(&have, &want, sizeof want) != 0) _tile_loadconfig(&want);
}

// Linux hands the tile registers' state to a process only when it asks (arch_prctl); true where it did.
static bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

// One block: the inputs at x8 into tile TA (the intrinsics name tiles by literal numbers, hence a macro),
// against NV panels' weights w[v], sums into dots[v].
#define AMX_PANEL(TA, TB, TC, v)      \
    _tile_loadd(TB, w[v], 64);        \
    _tile_zero(TC);                   \
    _tile_dpbsud(TC, TA, TB);         \
    _tile_stored(TC, dots[v], 64);
#define AMX_BLOCK(TA)                                 \
    _tile_loadd(TA, x8, K);                           \
    AMX_PANEL(TA, 1, 4, 0)                                \
    if constexpr (NV > 1) { AMX_PANEL(TA, 2, 5, 1) }      \
    if constexpr (NV > 2) { AMX_PANEL(TA, 1, 6, 2) }      \
    if constexpr (NV > 3) { AMX_PANEL(TA, 2, 7, 3) }
template <int NV>
static inline void amx_block(bool odd, const int8_t *x8, int K, const uint8_t *const *w, int32_t (*dots)[16 * PANEL]) {
    if (odd) {  // two input tiles in turn: a block's load need not wait for the last one's products
        AMX_BLOCK(3)
    } else {
        AMX_BLOCK(0)
    }
}
#undef AMX_BLOCK
#undef AMX_PANEL

// m <= 8 input rows (from r0) x NV panels (from column n), the tiles configured for m: `qtile`'s sums on
// the tile unit, then its float epilogue, the accumulators in memory.
template <bool NIB, int QB, int NV>
static void amx_tile(const QX &x, int r0, int m, const QSeg &s, float *y, int ldy, int n, int N, bool add) {
    const int K = x.K, nb = K / QB, unit = s.skind == W_FACTORS ? 256 : QB, per = unit / QB;
    const size_t scales = s.skind == W_FACTORS ? (size_t)(2 + per) * PANEL * (1 + s.offsets)
                                               : (size_t)(s.skind == W_F32 ? 4 : 2) * PANEL * (1 + s.offsets);
    constexpr size_t BB = (size_t)QB * PANEL / (NIB ? 2 : 1);  // a block's weight bytes in a panel
    const size_t ub = scales + per * BB, vq = (size_t)(K / unit) * ub;
    const uint8_t *p = s.w + (size_t)(n / PANEL) * vq;
    const int8_t *x8 = x.x8 + (size_t)2 * r0 * K;
    const int32_t *sums = (QB == 16 ? x.s16 : x.s32) + (size_t)r0 * nb;
    const float *mx = (QB == 16 ? x.mx16 : x.mx32) + (size_t)r0 * nb, *sx = x.sx + (size_t)r0 * (K / 32);
    alignas(64) float c[8 * NV * PANEL];
    alignas(64) int32_t dots[AMX_CHUNK][NV][16 * PANEL];
    alignas(64) uint8_t spread[NIB ? AMX_CHUNK : 1][NV][QB * PANEL];
    for (int i = 0; i < m * NV * PANEL; i++) c[i] = 0.0f;
    for (int b0 = 0; b0 < nb; b0 += AMX_CHUNK) {
        const int nc = nb - b0 < AMX_CHUNK ? nb - b0 : AMX_CHUNK;
        const uint8_t *w[AMX_CHUNK][NV];
        // the next chunk's bytes, each panel's: the hardware's prefetcher does not keep up with NV streams
        const size_t from = (size_t)(b0 + AMX_CHUNK) * ub / per, to = (size_t)(b0 + 2 * AMX_CHUNK) * ub / per;
        for (int v = 0; v < NV; v++)
            for (size_t at = from; at < to && at < vq; at += 64) _mm_prefetch((const char *)(p + v * vq + at), _MM_HINT_T0);
        for (int j = 0; j < nc; j++)
            for (int v = 0; v < NV; v++) {
                const int b = b0 + j;
                w[j][v] = p + v * vq + (size_t)(b / per) * ub + scales + (size_t)(b % per) * BB;
                if constexpr (NIB) {  // a load of 4 PANEL bytes holds groups 2i (low nibbles) and 2i+1 (high)
                    for (int i = 0; i < QB / 8; i++) {
                        const __m512i u = _mm512_loadu_si512((const void *)(w[j][v] + 64 * i));
                        _mm512_store_si512((void *)(spread[j][v] + 128 * i), i_low(u));
                        _mm512_store_si512((void *)(spread[j][v] + 128 * i + 64), i_high(u));
                    }
                    w[j][v] = spread[j][v];
                }
            }
        for (int j = 0; j < nc; j++) amx_block<NV>(j % 2, x8 + (b0 + j) * QB, K, w[j], dots[j]);
        for (int v = 0; v < NV; v++) {  // the epilogue, each accumulator in a register over the chunk
            vec dv[AMX_CHUNK], mv[AMX_CHUNK];
            for (int j = 0; j < nc; j++) {
                const int b = b0 + j;
                const uint8_t *h = p + v * vq + (size_t)(b / per) * ub;
                dv[j] = unit_scale(h, s.skind, s.offsets, per, b % per, false);
                mv[j] = s.offsets ? unit_scale(h, s.skind, s.offsets, per, b % per, true) : dv[j];
            }
            for (int r = 0; r < m; r++) {  // the sums' rows 2r and 2r + 1: row r's hi and lo
                float *acc = c + (r * NV + v) * PANEL;
                vec a = v_load(acc);
                for (int j = 0; j < nc; j++) {
                    const int b = b0 + j;
                    const int32_t *d = dots[j][v] + 2 * r * PANEL;
                    const ivec sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(d), 8), _mm512_load_si512(d + PANEL));
                    const ivec dot = s.bias ? i_sub(sum, s.bias * sums[(size_t)r * nb + b]) : sum;
                    a = v_fma(i_float(dot), v_mul(dv[j], v_bcast(sx + (size_t)r * (K / 32) + b * QB / 32)), a);
                    if (s.offsets) a = v_fma(mv[j], v_bcast(mx + (size_t)r * nb + b), a);
                }
                v_store(acc, a);
            }
        }
    }
    for (int i = 0; i < m * NV; i++) {
        const int col = n + PANEL * (i % NV);
        store_panel(y + (size_t)(r0 + i / NV) * ldy + col, v_load(c + i * PANEL), col, N, add);
    }
}

// Every input row against np panels from column n0: rows in groups of at most 8 (16 rows of the tile),
// of sizes as equal as can be, each meeting the panels AMX_NV at a time.
template <bool NIB, int QB>
static void amx_rows(const QX &x, int M, const QSeg &s, float *y, int ldy, int n0, int np, bool add) {
    for (int r0 = 0, groups = (M + 7) / 8; r0 < M; groups--) {
        const int m = (M - r0 + groups - 1) / groups;
        amx_configure(m, QB);
        int v = 0;
        for (; v + AMX_NV <= np; v += AMX_NV) amx_tile<NIB, QB, AMX_NV>(x, r0, m, s, y, ldy, n0 + PANEL * v, s.rows, add);
        const int left = np - v, at = n0 + PANEL * v;
        if (left == 3) amx_tile<NIB, QB, 3>(x, r0, m, s, y, ldy, at, s.rows, add);
        if (left == 2) amx_tile<NIB, QB, 2>(x, r0, m, s, y, ldy, at, s.rows, add);
        if (left == 1) amx_tile<NIB, QB, 1>(x, r0, m, s, y, ldy, at, s.rows, add);
        r0 += m;
    }
}
#else
#define HAVE_AMX 0
#define AMX_ROWS 0
static inline bool amx_permitted() { return false; }
#endif

// Whether products of AMX_ROWS rows or more go to the tile unit: set by `smallem_amx`.
static bool amx_on = false;

// Turn the tile unit's path on (where this build has it and Linux permits it) or off -> whether it is on.
extern "C" int smallem_amx(int on) {
    amx_on = on && HAVE_AMX && amx_permitted();
    return amx_on;
}
