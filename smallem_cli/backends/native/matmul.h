// The products of the native engine over weights in panels (float16, bfloat16, float32, or a
// proposer's int8), and the RMSNorm rows.
#pragma once

#include "vec.h"

// A panel is one vector register of output rows: sixteen where the library is built for
// AVX-512 (`native/kernels.py`), else eight (AVX2). On this CPU a loop of independent FMAs ran
// 110-112 GFLOP/s a core on 512-bit registers against 67 on 256-bit ones, and a pass over a few
// rows is bound by them; the vector helpers (vec.h, attention.h) stay AVX2.
#if defined(__AVX512F__)
#define PANEL 16
typedef __m512 vec;
static inline vec v_zero() { return _mm512_setzero_ps(); }
static inline vec v_bcast(const float *x) { return _mm512_set1_ps(*x); }
static inline vec v_fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec v_add(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec v_mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec load16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vec loadb16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vec load8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#else
#define PANEL 8
typedef __m256 vec;
static inline vec v_zero() { return _mm256_setzero_ps(); }
static inline vec v_bcast(const float *x) { return _mm256_broadcast_ss(x); }
static inline vec v_fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void v_store(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec v_add(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec v_mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec load16(const uint16_t *p) { return load_h(p); }
static inline vec loadb16(const uint16_t *p) { return load_b(p); }
static inline vec load8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

// A weight matrix in panels (below): the model's own values in the narrowest of float16,
// bfloat16 and float32 that holds them exactly (the target, always), or int8 with a float32 scale
// per output row, row n being scale[n] * q[n] (a proposer's, where the caller asks for it:
// `native.panels8`). A proposer's numbers change only how often its draft tokens are accepted; a
// greedy output is the target's whatever they are, and a sampled draft token is verified against
// the q it was drawn from.
// Or a GGUF file's blocks as it stores them (W_Q: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
// segments of rows of one type each, unsigned q in 8 or 4 bits with their blocks' scales
// (`qmatmul.h`, `native/blocks.py`), multiplied in integers, not dequantized to float32's four bytes.
enum { W_F16 = 0, W_BF16 = 1, W_F32 = 2, W_Q = 3 };
struct QSeg;
struct Mat {
    const void *w;          // the panels (W_Q: the first segment's)
    const float *scale;     // [panels * PANEL] (the last panel's padding included): int8; null: `kind`
    int kind;               // W_F16, W_BF16, W_F32 or W_Q
    const QSeg *seg;        // W_Q: the segments, one below the other
    int nseg;
};
struct F16 {
    using T = uint16_t;
    static inline vec load(const uint16_t *p) { return load16(p); }
};
struct BF16 {
    using T = uint16_t;
    static inline vec load(const uint16_t *p) { return loadb16(p); }
};
struct F32 {
    using T = float;
    static inline vec load(const float *p) { return v_load(p); }
};
struct I8 {
    using T = int8_t;
    static inline vec load(const int8_t *p) { return load8(p); }
};

// y[m, n] (+)= sum_k x[m, k] W[n, k] for m < M, n < N, with W in panels of PANEL output
// columns (`native.panels`): wp[(n / PANEL) K + k][n % PANEL], float16 or int8 (`Mat`), the last
// panel padded.
//
// A tile holds MR input rows x NV panels in ACC accumulators: 12 of AVX2's 16 registers, 24 of
// AVX-512's 32 (the rest: the panels or the broadcast inputs, and one temporary). Each k adds
// x[m, k] * W[n .. n+PANEL, k] to every one of them, one FMA per accumulator, no horizontal sums
// at the end. Every output is one float32 sum over k = 0 .. K-1 in order, whatever tile holds
// it: a token's numbers do not depend on how many rows the pass has, nor on the build.
#if PANEL == 16
#define ACC 24
#define MAX_MR 12  // rows a tile holds: 12 x 2 panels
#else
#define ACC 12
#define MAX_MR 6
#endif
// The fewest rows a tile prefetches its next panels for (`tile`): the build's -D, else 8.
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif
#define ACC24(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) \
                 F(12) F(13) F(14) F(15) F(16) F(17) F(18) F(19) F(20) F(21) F(22) F(23)
// One accumulator's PANEL outputs at o, column col of N real ones (the last panel is padded):
// stored, or added to what is there.
static inline void store_panel(float *o, vec acc, int col, int N, bool add) {
    if (col + PANEL <= N) {
        v_store(o, add ? v_add(v_load(o), acc) : acc);
    } else {  // the last, padded panel: only its real columns
        float t[PANEL];
        v_store(t, acc);
        for (int c = 0; c < N - col; c++) o[c] = add ? o[c] + t[c] : t[c];
    }
}

// This thread's equal share [v0, v1) of the panels (whole panels, so no `omp for`).
static inline void panel_share(int panels, int *v0, int *v1) {
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    *v0 = (int)((long)panels * me / nt), *v1 = (int)((long)panels * (me + 1) / nt);
}

template <class W, int MR, int NV>
static inline void tile(const float *x, int ldx, const typename W::T *wp, const float *scale, int K, float *y, int ldy,
                        int n, int N, bool add) {
    static_assert(MR * NV <= ACC && MR >= 1 && NV >= 1, "too many accumulators");
    const vec z = v_zero();
#define DECL(i) vec c##i = z;
    ACC24(DECL)
#undef DECL
    const typename W::T *p = wp + (size_t)(n / PANEL) * K * PANEL;  // panel v of the tile at p + v K PANEL
    constexpr int line = 64 / (PANEL * sizeof(typename W::T));  // the k a cache line of a panel holds
    for (int k = 0; k < K; k++, p += PANEL, x++) {
        // Many rows read the panels at the pace of their arithmetic, too slowly for the hardware's
        // prefetcher on some CPUs: the next tile's panels (the NV after these) are asked for at
        // the same k, a tile ahead. Fewer rows than PREFETCH_ROWS go without: there it cost more
        // than it saved (the threshold by CPU maker, `kernels.prefetch_rows`; the measurements:
        // docs/decisions.md#the-prefetchs-threshold).
        if constexpr (MR >= PREFETCH_ROWS)
            if (k % line == 0)
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(p + (size_t)(v + NV) * K * PANEL), _MM_HINT_T0);
        if constexpr (MR >= 4) {  // NV panels in registers, one broadcast input at a time
            vec w[NV], b;
            for (int v = 0; v < NV; v++) w[v] = W::load(p + (size_t)v * K * PANEL);
#define FMA(i) if constexpr (i < MR * NV) { if constexpr (i % NV == 0) b = v_bcast(x + (size_t)(i / NV) * ldx); \
                                             c##i = v_fma(b, w[i % NV], c##i); }
            ACC24(FMA)
#undef FMA
        } else {  // MR <= 3 inputs in registers, one panel at a time
            vec b[MR], w;
            for (int m = 0; m < MR; m++) b[m] = v_bcast(x + (size_t)m * ldx);
#define FMA(i) if constexpr (i < MR * NV) { if constexpr (i % MR == 0) w = W::load(p + (size_t)(i / MR) * K * PANEL); \
                                             c##i = v_fma(b[i % MR], w, c##i); }
            ACC24(FMA)
#undef FMA
        }
    }
    // accumulator i: row i / NV, panel i % NV (MR >= 4), or row i % MR, panel i / MR
#define LIST(i) c##i,
    vec acc[24] = {ACC24(LIST)};
#undef LIST
    for (int i = 0; i < MR * NV; i++) {
        int m = MR >= 4 ? i / NV : i % MR, v = MR >= 4 ? i % NV : i / MR, col = n + PANEL * v;
        float *o = y + (size_t)m * ldy + col;
        if (scale) acc[i] = v_mul(acc[i], v_load(scale + col));  // int8: the rows' scales
        store_panel(o, acc[i], col, N, add);
    }
}
#undef ACC24

// Tiles of MR rows over panels [0, np) of a chunk: NV panels at a time, then the rest.
template <class W, int MR, int NV>
static inline void tiles(const float *x, int ldx, const typename W::T *wp, const float *scale, int K, float *y, int ldy,
                         int n0, int np, int N, bool add) {
    int v = 0;
    for (; v + NV <= np; v += NV) tile<W, MR, NV>(x, ldx, wp, scale, K, y, ldy, n0 + PANEL * v, N, add);
    if constexpr (NV > 1)
        if (np - v > 0) tiles<W, MR, NV - 1>(x, ldx, wp, scale, K, y, ldy, n0 + PANEL * v, np - v, N, add);
}

// Panels a tile of MR rows holds: as many as the accumulators allow, at most a chunk's 12.
static constexpr int nv_for(int mr) { return ACC / mr < 12 ? ACC / mr : 12; }

// Every input row against the np panels of one chunk (wp: its first panel, y: its first
// column, N: the real columns from there on): the rows in as few groups as tiles of MAX_MR
// allow, of sizes as equal as can be (AVX-512: up to 12 rows, 16 = 8 + 8, 25 = 9 + 8 + 8; AVX2:
// up to 6, 7 = 4 + 3), each group reading the chunk's panels once. With AVX-512, 9 to 12 rows in
// one tile of 2 panels took 5 to 13% less than two groups (9 = 5 + 4, 12 = 6 + 6); 16 rows in one
// tile of a panel (16 accumulators) took 10 to 30% more than 8 + 8, so 12 is the most.
template <class W>
static void rows_against(const float *x, int M, int ldx, const typename W::T *wp, const float *scale, int K, float *y,
                         int ldy, int np, int N, bool add) {
    for (int m = 0, groups = (M + MAX_MR - 1) / MAX_MR; m < M; groups--) {
        const int r = (M - m + groups - 1) / groups;
        const float *xm = x + (size_t)m * ldx;
        float *ym = y + (size_t)m * ldy;
        switch (r) {
#define ROWS(R) case R: if constexpr (R <= MAX_MR) tiles<W, R, nv_for(R)>(xm, ldx, wp, scale, K, ym, ldy, 0, np, N, add); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#undef ROWS
        }
        m += r;
    }
}

// Called inside the parallel region by every thread: each takes an equal share of the panels
// (whole panels, so no `omp for`), in chunks of 12 that every row group reads while they sit
// in L2, then a barrier.
template <class W>
static void matmul_of(const float *x, int M, int ldx, const typename W::T *wp, const float *scale, int N, int K, float *y,
                      int ldy, bool add) {
    int v0, v1;
    panel_share((N + PANEL - 1) / PANEL, &v0, &v1);
    for (int c = v0; c < v1; c += 12) {
        const int np = v1 - c < 12 ? v1 - c : 12;
        rows_against<W>(x, M, ldx, wp + (size_t)c * K * PANEL, scale ? scale + PANEL * c : nullptr, K, y + PANEL * c,
                        ldy, np, N - PANEL * c, add);
    }
#pragma omp barrier
}

#include "qmatmul.h"  // the blocks' products, over the panels above

static void matmul(const float *x, int M, int ldx, Mat w, int N, int K, float *y, int ldy, bool add) {
    if (w.kind == W_Q)
        matmul_q(x, M, ldx, w, N, K, y, ldy, add);
    else if (w.scale)
        matmul_of<I8>(x, M, ldx, (const int8_t *)w.w, w.scale, N, K, y, ldy, add);
    else if (w.kind == W_BF16)
        matmul_of<BF16>(x, M, ldx, (const uint16_t *)w.w, nullptr, N, K, y, ldy, add);
    else if (w.kind == W_F32)
        matmul_of<F32>(x, M, ldx, (const float *)w.w, nullptr, N, K, y, ldy, add);
    else
        matmul_of<F16>(x, M, ldx, (const uint16_t *)w.w, nullptr, N, K, y, ldy, add);
}

// One product, y [M, N] = x [M, K] W^T, for the tests of the kernels alone (not in kernels.SIGNATURES).
extern "C" void smallem_matmul(const Mat *w, const float *x, int M, int N, int K, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    matmul(x, M, K, *w, N, K, y, N, false);
}

// out[t] = x[t] / rms(x[t]) * g, for rows t shared out between the threads.
static void rms_rows(const float *x, int T, int d, float eps, const float *g, float *out) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *r = x + (size_t)t * d;
        __m256 s = _mm256_setzero_ps();
        for (int i = 0; i < d; i += 8) {
            __m256 v = _mm256_loadu_ps(r + i);
            s = _mm256_fmadd_ps(v, v, s);
        }
        float inv = 1.0f / sqrtf(hsum(s) / d + eps);
        for (int i = 0; i < d; i++) out[(size_t)t * d + i] = r[i] * inv * g[i];
    }
}
