// The products of a quantized file's matrices (`native/blocks.py`), as integer dot products.
//
// Why: converting each weight to float and multiplying it by each input row in float32 made a
// quantized file's pass compute-bound; an integer product takes 32 weight-input pairs an
// instruction (vpmaddwd, or AVX-512 VNNI's vpdpwssd: 16-bit pairs summed into 32-bit lanes), and
// a 4-bit weight is read in 4 bits.
//
// Each input row's blocks of 32 are quantized first (`quantize_row`): xq = round(x / sx), sx =
// max|x| / XQ_MAX, kept with the sums of xq over each 16 and 32. Sixteen bits, not llama.cpp's
// eight: an input rounded to int8 moves the logits by about 1e-2, enough to turn a greedy choice
// that float32 makes by a wider margin; to 16 bits, about 1e-4. A block b of B = 16 or 32 weights
// of output n is d[n, b] q[n, k] + m[n, b], q = u - bias with u the stored unsigned byte; then
//   y[r, n] = sum over b in order of  (sx[r, b] d[n, b]) * float(dot_b) + m[n, b] * (sx[r, b] sum_b xq)
// where dot_b = sum_k u[n, k] xq[r, k] - bias sum_b xq, an exact integer (the bias taken off in
// integers, so no float cancels it), each term one fused multiply-add in float32. Every output is
// that one sequence of float operations whatever the tile, the number of rows, or the build
// (AVX-512 with or without VNNI or AMX, AVX2: the integer sums are exact either way; |dot_b| < 32 *
// 255 * XQ_MAX < 2^31), so a row's numbers do not depend on the rows beside it. They are the eager pass's
// to the inputs' 16-bit rounding.
#pragma once

#include <vector>

#define W_FACTORS 4  // QSeg.skind: a K-quant's scales as the file factors them (`quant.Factors`)
// The largest |xq|: 127 * 256 + 127, so that xq = 256 hi + lo with hi and lo signed bytes (amx.h).
#define XQ_MAX 32639

// One segment of a matrix: `rows` output rows of one GGUF type (`blocks.QSeg`). A panel's bytes
// are one stream, unit after unit (a block, or a K-quant's 256 weights): the unit's scales, then
// its weights u = q + bias, [unit/4, PANEL, 4] bytes, or in nibbles [unit/8, PANEL, 4] (`blocks.py`).
struct QSeg {
    int rows, block, bias, nibbles;
    int skind;    // the scales: W_F16 or W_F32 (d, m [PANEL]), or W_FACTORS (d, dmin [PANEL] float16, sc, mn [blocks, PANEL] int8)
    int offsets;  // whether there are m (or dmin and mn)
    const uint8_t *w;
};

// The integer vectors: a panel's PANEL rows of 4 weights each, and a dot product of 4 pairs a lane:
// the weights' even bytes widened to 16 bits against the inputs k, k+2, the odd ones against k+1,
// k+3 (the inputs stored in that order: `quantize_row`), pairs of products summed into each 32-bit
// lane (exact: 255 * XQ_MAX * 2 < 2^31).
// The register's operations, 512 or 256 bits wide; what is built on them below is the same for both.
#if defined(__AVX512F__)
#define I_(op) _mm512_##op
typedef __m512i ivec;
static inline ivec i_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline ivec i_zero() { return _mm512_setzero_si512(); }
static inline ivec i_and(ivec a, ivec b) { return _mm512_and_si512(a, b); }
#else
#define I_(op) _mm256_##op
typedef __m256i ivec;
static inline ivec i_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec i_zero() { return _mm256_setzero_si256(); }
static inline ivec i_and(ivec a, ivec b) { return _mm256_and_si256(a, b); }
#endif
static inline ivec i_low(ivec v) { return i_and(v, I_(set1_epi8)(0x0F)); }
static inline ivec i_high(ivec v) { return i_and(I_(srli_epi16)(v, 4), I_(set1_epi8)(0x0F)); }
static inline ivec i_sub(ivec a, int32_t c) { return I_(sub_epi32)(a, I_(set1_epi32)(c)); }
static inline vec i_float(ivec a) { return I_(cvtepi32_ps)(a); }
struct WB { ivec e, o; };  // a group's even weight bytes and odd ones, each widened to 16 bits
struct XB { ivec e, o; };  // inputs k, k+2 and k+1, k+3, in every lane
static inline WB w_prep(ivec w) { return {i_and(w, I_(set1_epi16)(0xFF)), I_(srli_epi16)(w, 8)}; }
static inline ivec dot4(ivec a, const WB &w, const XB &x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(a, w.e, x.e), w.o, x.o);
#else
    return I_(add_epi32)(a, I_(add_epi32)(I_(madd_epi16)(w.e, x.e), I_(madd_epi16)(w.o, x.o)));
#endif
}
// Four 16-bit inputs (stored k, k+2, k+1, k+3), in every lane.
static inline XB x_at(const int16_t *p) {
    int32_t v[2];
    memcpy(v, p, 8);
    return {I_(set1_epi32)(v[0]), I_(set1_epi32)(v[1])};
}
#undef I_

// The quantized input rows: xq [M, K], and per row sx [K/32], the sums of xq over each 16 and 32
// (s16 [K/16], s32 [K/32]) and sx times them (mx16, mx32: the offsets' inputs).
// For the tile unit (amx.h), or null: xq = 256 hi + lo, hi and lo signed bytes in the inputs' own order,
// x8 [M, 2, K] (row r's hi, then its lo), in place of q.
struct QX {
    int16_t *q;
    float *sx, *mx16, *mx32;
    int32_t *s16, *s32;
    int K;
    int8_t *x8;
};
struct QXBuf {
    std::vector<int16_t> q;
    std::vector<float> f;
    std::vector<int32_t> s;
    std::vector<int8_t> b;
};

static inline int32_t hsum_i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One row's K inputs -> xq, sx and the sums (QX). A block of zeros has sx = 0 and xq = 0; one with a
// NaN has sx = NaN, so that the outputs are NaN as the float path's (a block with an infinity: sx
// infinite, its outputs not finite either).
static void quantize_row(const float *x, int K, int16_t *q, float *sx, int32_t *s16, int32_t *s32, float *mx16,
                         float *mx32, int8_t *x8) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lo = _mm256_set1_epi32(-XQ_MAX), hi = _mm256_set1_epi32(XQ_MAX);
    for (int b = 0; b < K / 32; b++) {
        __m256 v[4], top = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        const float s = _mm256_movemask_ps(nan) ? NAN : hmax(top) / (float)XQ_MAX;
        __m256i t[4];
        for (int i = 0; i < 4; i++)  // round half to even (the default rounding mode), within +-XQ_MAX
            t[i] = s > 0.0f ? _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_div_ps(v[i], _mm256_set1_ps(s)))))
                            : _mm256_setzero_si256();
        int32_t all[32];
        for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(all + 8 * i), t[i]);
        if (x8)  // for the tile unit: hi and lo, the registers' order unused
            for (int i = 0; i < 32; i++) {
                const int h = (all[i] + 128) >> 8;  // within +-127, as |xq| <= XQ_MAX
                x8[32 * b + i] = (int8_t)h, x8[K + 32 * b + i] = (int8_t)(all[i] - 256 * h);
            }
        else
            for (int g = 0; g < 32; g += 4)  // each 4 as x_at reads them: k, k+2, then k+1, k+3
                q[32 * b + g] = (int16_t)all[g], q[32 * b + g + 1] = (int16_t)all[g + 2],
                q[32 * b + g + 2] = (int16_t)all[g + 1], q[32 * b + g + 3] = (int16_t)all[g + 3];
        const int32_t a = hsum_i(_mm256_add_epi32(t[0], t[1])), c = hsum_i(_mm256_add_epi32(t[2], t[3]));
        sx[b] = s;
        s16[2 * b] = a, s16[2 * b + 1] = c, s32[b] = a + c;
        mx16[2 * b] = s * (float)a, mx16[2 * b + 1] = s * (float)c, mx32[b] = s * (float)(a + c);
    }
}

// The scratch grown for M rows of K (and their bytes, where `bytes`), and where each part of it lies.
static QX qx_of(QXBuf &buf, int M, int K, bool bytes) {
    const size_t n32 = (size_t)M * (K / 32), n = (size_t)M * K;
    if (buf.q.size() < n) buf.q.resize(n);
    if (buf.f.size() < 4 * n32) buf.f.resize(4 * n32);
    if (buf.s.size() < 3 * n32) buf.s.resize(3 * n32);
    if (bytes && buf.b.size() < 2 * n) buf.b.resize(2 * n);
    return QX{buf.q.data(), buf.f.data(), buf.f.data() + n32, buf.f.data() + 3 * n32, buf.s.data(), buf.s.data() + 2 * n32,
              K, bytes ? buf.b.data() : nullptr};
}
static void quantize_into(const QX &qx, const float *x, int r, int ldx) {
    const int K = qx.K;
    const size_t at = (size_t)r * (K / 32);
    quantize_row(x + (size_t)r * ldx, K, qx.q + (size_t)r * K, qx.sx + at, qx.s16 + 2 * at, qx.s32 + at, qx.mx16 + 2 * at,
                 qx.mx32 + at, qx.x8 ? qx.x8 + (size_t)2 * r * K : nullptr);
}

// The rows quantized, the same numbers however it is shared out. A few rows: by every thread into
// its own scratch (no barrier; they cost far less than the product). More: shared out between the
// threads, into the scratch of the one thread that grows it (`single` hands its address to all).
#ifndef QX_SHARED_ROWS
#define QX_SHARED_ROWS 4
#endif
static QX quantize_rows(const float *x, int M, int ldx, int K, bool bytes) {
    static thread_local QXBuf buf;
    if (M < QX_SHARED_ROWS) {
        const QX qx = qx_of(buf, M, K, bytes);
        for (int r = 0; r < M; r++) quantize_into(qx, x, r, ldx);
        return qx;
    }
    QXBuf *shared;
#pragma omp single copyprivate(shared)
    {
        qx_of(buf, M, K, bytes);
        shared = &buf;
    }
    const QX qx = qx_of(*shared, M, K, bytes);  // grown already: the same addresses in every thread
#pragma omp for schedule(static)
    for (int r = 0; r < M; r++) quantize_into(qx, x, r, ldx);
    return qx;
}

// A panel's PANEL scales (m: offsets) of block j of the unit whose scales are at h: float16, float32,
// or the file's factors (an int8 times a float16: exact in float32).
static inline vec unit_scale(const uint8_t *h, int skind, int offsets, int per, int j, bool m) {
    if (skind == W_FACTORS) {
        const int8_t *sub = (const int8_t *)(h + 2 * PANEL * (1 + offsets)) + (size_t)((m ? per : 0) + j) * PANEL;
        return v_mul(load8(sub), load16((const uint16_t *)h + (m ? PANEL : 0)));
    }
    return skind == W_F32 ? v_load((const float *)h + (m ? PANEL : 0)) : load16((const uint16_t *)h + (m ? PANEL : 0));
}

// MR input rows (from r0) x NV panels (from column n of the segment): the formula above. The
// integer sums of a block in MR x NV registers, the float ones in as many again.
#define Q_ACC (ACC / 2)
#define QPF 1024  // how far ahead a few rows' tile prefetches each panel's stream, in bytes
template <bool NIB, int QB, int MR, int NV>
static inline void qtile(const QX &x, int r0, const QSeg &s, float *y, int ldy, int n, int N, bool add) {
    static_assert(MR * NV <= Q_ACC && MR >= 1 && NV >= 1, "too many accumulators");
    constexpr int STEP = NIB ? 8 : 4;  // the k one load of a panel's 4 * PANEL bytes holds
    const int K = x.K, nb = K / QB, unit = s.skind == W_FACTORS ? 256 : QB, per = unit / QB;
    const size_t scales = s.skind == W_FACTORS ? (size_t)(2 + per) * PANEL * (1 + s.offsets)
                                               : (size_t)(s.skind == W_F32 ? 4 : 2) * PANEL * (1 + s.offsets);
    const size_t vq = (size_t)(K / unit) * (scales + (size_t)unit * PANEL / (NIB ? 2 : 1));  // a panel's bytes
    const uint8_t *p = s.w + (size_t)(n / PANEL) * vq, *h = p;
    const int16_t *xq = x.q + (size_t)r0 * K;
    const int32_t *sums = (QB == 16 ? x.s16 : x.s32) + (size_t)r0 * nb;
    const float *mx = (QB == 16 ? x.mx16 : x.mx32) + (size_t)r0 * nb, *sx = x.sx + (size_t)r0 * (K / 32);
    vec c[MR * NV];
    ivec a[MR * NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR * NV; i++) c[i] = v_zero();
    for (int b = 0; b < nb; b++) {
        if (b % per == 0) h = p, p += scales;  // a unit's scales, then its weights
#pragma GCC unroll 16
        for (int i = 0; i < MR * NV; i++) a[i] = i_zero();
#pragma GCC unroll 8
        for (int g = b * QB; g < (b + 1) * QB; g += STEP, p += 4 * PANEL) {
            if constexpr (MR >= 4) {  // NV panels in registers, one row's inputs at a time
                WB w[NV], w2[NIB ? NV : 1];
#pragma GCC unroll 16
                for (int v = 0; v < NV; v++) {
                    const ivec u = i_load(p + v * vq);
                    w[v] = w_prep(NIB ? i_low(u) : u);
                    if constexpr (NIB) w2[v] = w_prep(i_high(u));
                }
#pragma GCC unroll 16
                for (int r = 0; r < MR; r++) {
                    const XB xb = x_at(xq + (size_t)r * K + g);
#pragma GCC unroll 16
                    for (int v = 0; v < NV; v++) a[r * NV + v] = dot4(a[r * NV + v], w[v], xb);
                    if constexpr (NIB) {
                        const XB xb2 = x_at(xq + (size_t)r * K + g + 4);
#pragma GCC unroll 16
                        for (int v = 0; v < NV; v++) a[r * NV + v] = dot4(a[r * NV + v], w2[v], xb2);
                    }
                }
            } else {  // MR <= 3 rows' inputs in registers, one panel at a time
                // A row or three reads each panel's stream faster than the hardware's prefetcher
                // fetches NV of them: each step asks for the line QPF bytes on (past a tile's end,
                // the next tile's: a prefetch never faults).
#pragma GCC unroll 16
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(p + v * vq + QPF), _MM_HINT_T0);
                XB xb[MR], xb2[NIB ? MR : 1];
#pragma GCC unroll 4
                for (int r = 0; r < MR; r++) {
                    xb[r] = x_at(xq + (size_t)r * K + g);
                    if constexpr (NIB) xb2[r] = x_at(xq + (size_t)r * K + g + 4);
                }
#pragma GCC unroll 16
                for (int v = 0; v < NV; v++) {
                    const ivec u = i_load(p + v * vq);
                    const WB w = w_prep(NIB ? i_low(u) : u);
#pragma GCC unroll 4
                    for (int r = 0; r < MR; r++) a[r * NV + v] = dot4(a[r * NV + v], w, xb[r]);
                    if constexpr (NIB) {
                        const WB w2 = w_prep(i_high(u));
#pragma GCC unroll 4
                        for (int r = 0; r < MR; r++) a[r * NV + v] = dot4(a[r * NV + v], w2, xb2[r]);
                    }
                }
            }
        }
#pragma GCC unroll 16
        for (int v = 0; v < NV; v++) {
            const vec dv = unit_scale(h + v * vq, s.skind, s.offsets, per, b % per, false);
            const vec mv = s.offsets ? unit_scale(h + v * vq, s.skind, s.offsets, per, b % per, true) : dv;
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const ivec dot = s.bias ? i_sub(a[r * NV + v], s.bias * sums[(size_t)r * nb + b]) : a[r * NV + v];
                const vec scale = v_mul(dv, v_bcast(sx + (size_t)r * (K / 32) + b * QB / 32));
                c[r * NV + v] = v_fma(i_float(dot), scale, c[r * NV + v]);
                if (s.offsets) c[r * NV + v] = v_fma(mv, v_bcast(mx + (size_t)r * nb + b), c[r * NV + v]);
            }
        }
    }
    for (int i = 0; i < MR * NV; i++) {
        const int col = n + PANEL * (i % NV);
        store_panel(y + (size_t)(r0 + i / NV) * ldy + col, c[i], col, N, add);
    }
}

template <bool NIB, int QB, int MR, int NV>
static inline void qtiles(const QX &x, int r0, const QSeg &s, float *y, int ldy, int n0, int np, int N, bool add) {
    int v = 0;
    for (; v + NV <= np; v += NV) qtile<NIB, QB, MR, NV>(x, r0, s, y, ldy, n0 + PANEL * v, N, add);
    if constexpr (NV > 1)
        if (np - v > 0) qtiles<NIB, QB, MR, NV - 1>(x, r0, s, y, ldy, n0 + PANEL * v, np - v, N, add);
}

// Row r of a quantized matrix's segments, its values d q (+ m) into out [K], rounded as `Blocked.values`
// (d q, then + m): a tied head's blocks read back as the token embedding, one copy of the matrix.
static void q_row(const QSeg *s, int64_t r, int K, float *out) {
    while (r >= s->rows) r -= s->rows, s++;
    const int unit = s->skind == W_FACTORS ? 256 : s->block, per = unit / s->block, c = (int)(r % PANEL);
    const size_t scales = s->skind == W_FACTORS ? (size_t)(2 + per) * PANEL * (1 + s->offsets)
                                                : (size_t)(s->skind == W_F32 ? 4 : 2) * PANEL * (1 + s->offsets);
    const size_t bytes = (size_t)unit * PANEL / (s->nibbles ? 2 : 1), vq = (size_t)(K / unit) * (scales + bytes);
    const uint8_t *p = s->w + (size_t)(r / PANEL) * vq;
    for (int u = 0; u < K / unit; u++, p += scales + bytes)
        for (int j = 0; j < per; j++) {
            float d, m = 0.0f;
            if (s->skind == W_FACTORS) {  // an int8 times a float16, as `unit_scale`
                const int8_t *sub = (const int8_t *)(p + 2 * PANEL * (1 + s->offsets));
                d = (float)sub[j * PANEL + c] * _cvtsh_ss(((const uint16_t *)p)[c]);
                if (s->offsets) m = (float)sub[(per + j) * PANEL + c] * _cvtsh_ss(((const uint16_t *)p)[PANEL + c]);
            } else if (s->skind == W_F32) {
                d = ((const float *)p)[c], m = s->offsets ? ((const float *)p)[PANEL + c] : 0.0f;
            } else {
                d = _cvtsh_ss(((const uint16_t *)p)[c]);
                m = s->offsets ? _cvtsh_ss(((const uint16_t *)p)[PANEL + c]) : 0.0f;
            }
            for (int k = j * s->block; k < (j + 1) * s->block; k++) {  // k within the unit
                const int g = k / 4;  // its group of 4; with nibbles, groups 2i and 2i+1 share one group's bytes
                const uint8_t b = p[scales + (size_t)(s->nibbles ? g / 2 : g) * PANEL * 4 + c * 4 + k % 4];
                const int q = (s->nibbles ? (g % 2 ? b >> 4 : b & 15) : b) - s->bias;
                const float v = d * (float)q;
                out[u * unit + k] = s->offsets ? v + m : v;
            }
        }
}

static constexpr int qnv_for(int mr) { return Q_ACC / mr; }

#include "amx.h"  // the same products on the tile unit

// Every input row against np panels of a segment from column n0 (y: the segment's first column):
// the rows in groups of at most Q_ACC, of sizes as equal as can be, each reading the panels once.
template <bool NIB, int QB>
static void qrows(const QX &x, int M, const QSeg &s, float *y, int ldy, int n0, int np, bool add) {
#if HAVE_AMX
    if (x.x8) return amx_rows<NIB, QB>(x, M, s, y, ldy, n0, np, add);
#endif
    for (int r0 = 0, groups = (M + Q_ACC - 1) / Q_ACC; r0 < M; groups--) {
        const int r = (M - r0 + groups - 1) / groups;
        switch (r) {
#define QROWS(R) case R: if constexpr (R <= Q_ACC) qtiles<NIB, QB, R, qnv_for(R)>(x, r0, s, y, ldy, n0, np, s.rows, add); break;
        QROWS(1) QROWS(2) QROWS(3) QROWS(4) QROWS(5) QROWS(6) QROWS(7) QROWS(8) QROWS(9) QROWS(10) QROWS(11) QROWS(12)
#undef QROWS
        }
        r0 += r;
    }
}

// Called inside the parallel region by every thread: the rows quantized, then each segment's
// panels shared out as `matmul_of` shares a matrix's, in chunks of 12 that every row group reads
// while they sit in L2; one barrier at the end.
static void matmul_q(const float *x, int M, int ldx, Mat w, int N, int K, float *y, int ldy, bool add) {
    const QX qx = quantize_rows(x, M, ldx, K, amx_on && M >= AMX_ROWS);
    int at = 0;
    for (int i = 0; i < w.nseg; i++) {
        const QSeg &s = w.seg[i];
        int v0, v1;
        panel_share((s.rows + PANEL - 1) / PANEL, &v0, &v1);
        for (int c = v0; c < v1; c += 12) {
            const int np = v1 - c < 12 ? v1 - c : 12;
            if (s.nibbles)
                qrows<true, 32>(qx, M, s, y + at, ldy, PANEL * c, np, add);
            else if (s.block == 16)
                qrows<false, 16>(qx, M, s, y + at, ldy, PANEL * c, np, add);
            else
                qrows<false, 32>(qx, M, s, y + at, ldy, PANEL * c, np, add);
        }
        at += s.rows;
    }
    (void)N;  // the segments' rows, together
#pragma omp barrier
}
