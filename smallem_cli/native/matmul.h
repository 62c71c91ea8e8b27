// The products of the native engine over float16 weights in panels, and the RMSNorm rows.
#pragma once

#include "vec.h"

// A weight matrix in panels (below): float16 (the checkpoint's own values: the target, always),
// or int8 with a float32 scale per output row, row n being scale[n] * q[n] (a proposer's, where
// the caller asks for it: `native.panels8`). A proposer's numbers change only how often its
// guesses are kept; a greedy output is the target's whatever they are, and a sampled guess is
// verified against the q it was drawn from.
struct Mat {
    const void *w;
    const float *scale;  // [panels * 8] (the last panel's padding included), or null: float16
};
struct F16 {
    using T = uint16_t;
    static inline __m256 load(const uint16_t *p) { return load_h(p); }
};
struct I8 {
    using T = int8_t;
    static inline __m256 load(const int8_t *p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    }
};

// y[m, n] (+)= sum_k x[m, k] W[n, k] for m < M, n < N, with W in panels of eight output
// columns (`native.panels`): wp[(n / 8) K + k][n % 8], float16 or int8 (`Mat`), the last panel padded.
//
// A tile holds MR input rows x NV panels in 12 accumulators (16 registers: 12 + the panels
// or the broadcast inputs + one temporary): each k adds x[m, k] * W[n .. n+8, k] to every
// one of them, one FMA per accumulator, no horizontal sums at the end. Every output is one
// float32 sum over k = 0 .. K-1 in order, whatever tile holds it: a token's numbers do not
// depend on how many rows the pass has.
#define ACC12(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
template <class W, int MR, int NV>
static inline void tile(const float *x, int ldx, const typename W::T *wp, const float *scale, int K, float *y, int ldy,
                        int n, int N, bool add) {
    static_assert(MR * NV <= 12 && MR >= 1 && NV >= 1, "at most 12 accumulators");
    const __m256 z = _mm256_setzero_ps();
#define DECL(i) __m256 c##i = z;
    ACC12(DECL)
#undef DECL
    const typename W::T *p = wp + (size_t)(n / 8) * K * 8;  // panel n / 8; panel v of the tile at p + v K 8
    for (int k = 0; k < K; k++, p += 8, x++) {
        // Several rows read the panels at the pace of their arithmetic, too slowly for the
        // hardware's prefetcher: the next tile's panels (the NV after these) are asked for at the
        // same k, a tile ahead (against 4 KB ahead in each panel: passes over 2, 5 and 16 rows
        // 8, 3 to 6 and 1 to 4% faster, the two libraries alternated pass by pass in one process;
        // two tiles ahead, or into L2 only, no better). One row reads fast enough without (a
        // prefetch there made its pass 31% slower).
        if constexpr (MR > 1)
            if ((k & 3) == 0)
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(p + (size_t)(v + NV) * K * 8), _MM_HINT_T0);
        if constexpr (MR >= 4) {  // NV <= 3 panels in registers, one broadcast input at a time
            __m256 w[NV], b;
            for (int v = 0; v < NV; v++) w[v] = W::load(p + (size_t)v * K * 8);
#define FMA(i) if constexpr (i < MR * NV) { if constexpr (i % NV == 0) b = _mm256_broadcast_ss(x + (size_t)(i / NV) * ldx); \
                                             c##i = _mm256_fmadd_ps(b, w[i % NV], c##i); }
            ACC12(FMA)
#undef FMA
        } else {  // MR <= 3 inputs in registers, one panel at a time
            __m256 b[MR], w;
            for (int m = 0; m < MR; m++) b[m] = _mm256_broadcast_ss(x + (size_t)m * ldx);
#define FMA(i) if constexpr (i < MR * NV) { if constexpr (i % MR == 0) w = W::load(p + (size_t)(i / MR) * K * 8); \
                                             c##i = _mm256_fmadd_ps(b[i % MR], w, c##i); }
            ACC12(FMA)
#undef FMA
        }
    }
    // accumulator i: row i / NV, panel i % NV (MR >= 4), or row i % MR, panel i / MR
    __m256 acc[12] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
    for (int i = 0; i < MR * NV; i++) {
        int m = MR >= 4 ? i / NV : i % MR, v = MR >= 4 ? i % NV : i / MR, col = n + 8 * v;
        float *o = y + (size_t)m * ldy + col;
        if (scale) acc[i] = _mm256_mul_ps(acc[i], _mm256_loadu_ps(scale + col));  // int8: the rows' scales
        if (col + 8 <= N) {
            _mm256_storeu_ps(o, add ? _mm256_add_ps(_mm256_loadu_ps(o), acc[i]) : acc[i]);
        } else {  // the last, padded panel: only its real columns
            float t[8];
            _mm256_storeu_ps(t, acc[i]);
            for (int c = 0; c < N - col; c++) o[c] = add ? o[c] + t[c] : t[c];
        }
    }
}
#undef ACC12

// Tiles of MR rows over panels [0, np) of a chunk: NV panels at a time, then the rest.
template <class W, int MR, int NV>
static inline void tiles(const float *x, int ldx, const typename W::T *wp, const float *scale, int K, float *y, int ldy,
                         int n0, int np, int N, bool add) {
    int v = 0;
    for (; v + NV <= np; v += NV) tile<W, MR, NV>(x, ldx, wp, scale, K, y, ldy, n0 + 8 * v, N, add);
    if constexpr (NV > 1)
        if (np - v > 0) tiles<W, MR, NV - 1>(x, ldx, wp, scale, K, y, ldy, n0 + 8 * v, np - v, N, add);
}

// Every input row against the np panels of one chunk (wp: its first panel, y: its first
// column, N: the real columns from there on): rows in groups of six, then the rest (7 = 4 + 3
// and 8 = 4 + 4 rows, so that no group has one or two).
template <class W>
static void rows_against(const float *x, int M, int ldx, const typename W::T *wp, const float *scale, int K, float *y,
                         int ldy, int np, int N, bool add) {
    int m = 0;
    for (; M - m >= 6 && M - m != 7 && M - m != 8; m += 6)
        tiles<W, 6, 2>(x + (size_t)m * ldx, ldx, wp, scale, K, y + (size_t)m * ldy, ldy, 0, np, N, add);
    while (m < M) {
        const float *xm = x + (size_t)m * ldx;
        float *ym = y + (size_t)m * ldy;
        switch (M - m) {
        case 5: tiles<W, 5, 2>(xm, ldx, wp, scale, K, ym, ldy, 0, np, N, add); m += 5; break;
        case 3: tiles<W, 3, 4>(xm, ldx, wp, scale, K, ym, ldy, 0, np, N, add); m += 3; break;
        case 2: tiles<W, 2, 6>(xm, ldx, wp, scale, K, ym, ldy, 0, np, N, add); m += 2; break;
        case 1: tiles<W, 1, 12>(xm, ldx, wp, scale, K, ym, ldy, 0, np, N, add); m += 1; break;
        default: tiles<W, 4, 3>(xm, ldx, wp, scale, K, ym, ldy, 0, np, N, add); m += 4; break;  // 4, 7 or 8 rows
        }
    }
}

// Called inside the parallel region by every thread: each takes an equal share of the panels
// (whole panels, so no `omp for`), in chunks of 12 that every row group reads while they sit
// in L2, then a barrier.
template <class W>
static void matmul_of(const float *x, int M, int ldx, const typename W::T *wp, const float *scale, int N, int K, float *y,
                      int ldy, bool add) {
    const int panels = (N + 7) / 8, nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int v0 = (int)((long)panels * me / nt), v1 = (int)((long)panels * (me + 1) / nt);
    for (int c = v0; c < v1; c += 12) {
        const int np = v1 - c < 12 ? v1 - c : 12;
        rows_against<W>(x, M, ldx, wp + (size_t)c * K * 8, scale ? scale + 8 * c : nullptr, K, y + 8 * c, ldy, np,
                        N - 8 * c, add);
    }
#pragma omp barrier
}

static void matmul(const float *x, int M, int ldx, Mat w, int N, int K, float *y, int ldy, bool add) {
    if (w.scale)
        matmul_of<I8>(x, M, ldx, (const int8_t *)w.w, w.scale, N, K, y, ldy, add);
    else
        matmul_of<F16>(x, M, ldx, (const uint16_t *)w.w, nullptr, N, K, y, ldy, add);
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
