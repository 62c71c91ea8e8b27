// Attention of one query row over the keys it sees: a sequence's past and new keys, or a paged batch's slots.
#pragma once

#include "vec.h"

// How many keys on a row's scores and weighted sum ask for the rows they will read (AVX-512). A
// batch's keys lie in pages of 16 slots scattered over the slab, 2 KB a head: too short a run for
// the hardware's prefetcher, and 8 keys on is too close to hide a read from memory (the
// measurements: docs/benchmarks.md#rotary-rows-by-position-and-a-longer-prefetch).
#ifndef KV_AHEAD
#define KV_AHEAD 16
#endif

// A register of value columns: 8 (AVX2) or, in the AVX-512 build, 16. Either way each lane is
// the same ordered sum over keys, so the two give the same numbers. `ahead`: prefetch the value
// row KV_AHEAD keys on (measured with AVX-512 only; see attend_keys).
struct Y8 {
    using R = __m256;
    static constexpr int lanes = 8;
    static constexpr bool ahead = false;
    static R zero() { return _mm256_setzero_ps(); }
    static R set1(float x) { return _mm256_set1_ps(x); }
    static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
    static R load(const kv_t *p) { return kv_load8(p); }
    static void store(float *o, R a, float s) { _mm256_storeu_ps(o, _mm256_mul_ps(a, _mm256_set1_ps(s))); }
};
#if defined(__AVX512F__)
struct Z16 {
    using R = __m512;
    static constexpr int lanes = 16;
    static constexpr bool ahead = true;
    static R zero() { return _mm512_setzero_ps(); }
    static R set1(float x) { return _mm512_set1_ps(x); }
    static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
    static R load(const kv_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
    static void store(float *o, R a, float s) { _mm512_storeu_ps(o, _mm512_mul_ps(a, _mm512_set1_ps(s))); }
};
#endif

// out[0 .. NB * V::lanes) = inv * sum_j p[j] v_j over n rows v_j = row(j) (offset by the caller to
// the columns wanted): NB accumulators in registers, so the adds of one row do not wait on each other.
template <class V, int NB, class Row>
static inline void weigh_rows(const float *p, int n, Row row, int col, float inv, float *out) {
    typename V::R a[NB];
    for (int b = 0; b < NB; b++) a[b] = V::zero();
    for (int j = 0; j < n; j++) {
        const kv_t *v = row(j) + col;
        if (V::ahead && j + KV_AHEAD < n)
            for (int b = 0; b < NB * V::lanes * 2; b += 64)
                _mm_prefetch((const char *)(row(j + KV_AHEAD) + col) + b, _MM_HINT_T0);
        const typename V::R w = V::set1(p[j]);
        for (int b = 0; b < NB; b++) a[b] = V::fma(w, V::load(v + V::lanes * b), a[b]);
    }
    for (int b = 0; b < NB; b++) V::store(out + V::lanes * b, a[b], inv);
}

// Scores of keys s0 .. s0 + G - 1 (G = 4 or 8: G independent sums) into scores[s0 ..]; past
// the last key, key s0 stands in (a valid row whose score lands in the caller's spare room).
template <int G, class Key>
static inline void score_keys(const float *q, Key key, int s0, int n, int D, float *scores) {
    const kv_t *kg[G];
    for (int j = 0; j < G; j++) kg[j] = key(s0 + j < n ? s0 + j : s0);
    __m256 a[G];
    for (int j = 0; j < G; j++) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < G; j++) a[j] = _mm256_fmadd_ps(qv, kv_load8(kg[j] + i), a[j]);
    }
    for (int j = 0; j < G; j += 4) {
        __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[j], a[j + 1]), _mm256_hadd_ps(a[j + 2], a[j + 3]));
        _mm_storeu_ps(scores + s0 + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    }
}

#if defined(__AVX512F__)
// The same sums with 512-bit registers, half the conversions and instructions (a row's
// attention is bound by them): two keys to a register, key j's eight lanes beside key j+1's,
// each half doing what score_keys' 256-bit register does (the values: `Z16`).
static inline __m512 two_rows(const kv_t *a, const kv_t *b) {  // a[0 .. 8) | b[0 .. 8)
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
// Scores of keys s0 .. s0 + 2G - 1 (G even: G pairs in flight) against qq[c] = q's chunk c in
// both halves; past the last key, key s0 stands in.
template <int G, class Key>
static inline void score_pairs(const __m512 *qq, Key key, int s0, int n, int D, float *scores) {
    const kv_t *kg[2 * G];
    for (int j = 0; j < 2 * G; j++) kg[j] = key(s0 + j < n ? s0 + j : s0);
    __m512 a[G];
    for (int j = 0; j < G; j++) a[j] = _mm512_setzero_ps();
    for (int c = 0; c < D / 8; c++)
        for (int j = 0; j < G; j++) a[j] = _mm512_fmadd_ps(qq[c], two_rows(kg[2 * j] + 8 * c, kg[2 * j + 1] + 8 * c), a[j]);
    const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9, 1, 8, 0);
    for (int j = 0; j < G; j += 2) {  // score_keys' reduction, in each half: keys 2j, 2j+2 low, 2j+1, 2j+3 high
        const __m512 x = a[j], y = a[j + 1];
        __m512 h = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
        h = _mm512_add_ps(_mm512_shuffle_ps(h, h, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(h, h, _MM_SHUFFLE(3, 1, 3, 1)));
        h = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 3, 0, 1)));
        _mm_storeu_ps(scores + s0 + 2 * j, _mm512_castps512_ps128(_mm512_permutexvar_ps(order, h)));
    }
}
#endif

// The softmax weights of a row of n scores, in place: exp(score - max) -> 1 / their sum.
static inline float softmax_weights(float *scores, int n) {
    float mx = -INFINITY;
    int s = 0;
#if defined(__AVX512F__)
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    for (; s + 16 <= n; s += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(scores + s));
    mx = _mm512_reduce_max_ps(m16);
#endif
    for (; s < n; s++) mx = scores[s] > mx ? scores[s] : mx;
    __m256 vm = _mm256_set1_ps(mx), tot = _mm256_setzero_ps();
    s = 0;
    for (; s + 8 <= n; s += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + s), vm));
        _mm256_storeu_ps(scores + s, e);
        tot = _mm256_add_ps(tot, e);
    }
    float sum = hsum(tot);
    for (; s < n; s++) {
        float e = expf(scores[s] - mx);
        scores[s] = e;
        sum += e;
    }
    return 1.0f / sum;
}

// Attention of one query row over n keys key(0 .. n-1) and their values val(j), softmax in
// float32. q is pre-scaled; out [D]; scores: room for n + 8 floats. Every score is one 8-lane
// sum over D (lane i of chunk c adds q[8c + i] k[8c + i], c in order), reduced by the same
// pairwise adds, so a row that sees the same keys in the same order gets the same numbers,
// whatever pass holds it and however its keys are addressed (a strided view of one sequence,
// or slots of a paged batch), whether it runs here or beside another row (`attend_pairs`), and
// in either build (AVX2, or AVX-512's wider registers: the same lanes, the same order).
template <class Key, class Val>
static void attend_keys(const float *q, Key key, Val val, int n, int D, float *scores, float *out) {
    int s0 = 0;
#if defined(__AVX512F__)
    if (D <= 256) {
        __m512 qq[32];
        for (int c = 0; c < D / 8; c++) qq[c] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)(q + 8 * c))));
        for (; s0 + 8 <= n; s0 += 8) {
            // eight keys KV_AHEAD on asked for now: a batch's rows each read their own keys, from
            // the L3 or memory, and the hardware's prefetcher does not run ahead within a page
            for (int j = s0 + KV_AHEAD; j < s0 + KV_AHEAD + 8 && j < n; j++)
                for (int b = 0; b < D * 2; b += 64) _mm_prefetch((const char *)key(j) + b, _MM_HINT_T0);
            score_pairs<4>(qq, key, s0, n, D, scores);
        }
        for (; s0 < n; s0 += 4) score_pairs<2>(qq, key, s0, n, D, scores);
    }
#endif
    for (; s0 + 8 <= n; s0 += 8) score_keys<8>(q, key, s0, n, D, scores);  // eight sums in flight
    for (; s0 < n; s0 += 4) score_keys<4>(q, key, s0, n, D, scores);  // the rest: at most 3 wasted
    const float inv = softmax_weights(scores, n);
    for (int i = 0; i < D;) {  // up to 64 columns at a time, each in its own register
        const int left = (D - i) / 8;
#if defined(__AVX512F__)
        if (left >= 8) weigh_rows<Z16, 4>(scores, n, val, i, inv, out + i), i += 64;
        else if (left >= 4) weigh_rows<Z16, 2>(scores, n, val, i, inv, out + i), i += 32;
        else if (left >= 2) weigh_rows<Z16, 1>(scores, n, val, i, inv, out + i), i += 16;
#else
        if (left >= 8) weigh_rows<Y8, 8>(scores, n, val, i, inv, out + i), i += 64;
        else if (left >= 4) weigh_rows<Y8, 4>(scores, n, val, i, inv, out + i), i += 32;
        else if (left >= 2) weigh_rows<Y8, 2>(scores, n, val, i, inv, out + i), i += 16;
#endif
        else weigh_rows<Y8, 1>(scores, n, val, i, inv, out + i), i += 8;
    }
}

#if defined(__AVX512F__)
// Rows of one head side by side, two to a 512-bit register: [row a's 8 lanes | row b's 8
// lanes]. Each half does, lane for lane and in the same order, what attend_keys' 256-bit
// register does for its row, so every row gets attend_keys' numbers bit for bit; a key or
// value chunk is loaded once for all the rows (over 5 rows, attend_keys reads each key 5 times).
static inline __m512 both_halves(const kv_t *p) {  // p[0 .. 8) in each half
    return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)));
}
static inline __m512 halves(const float *a, const float *b) {  // a[0 .. 8) | b[0 .. 8)
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)a)),
                                               _mm256_loadu_pd((const double *)b), 1));
}
// _mm256_hadd_ps in each half: [a0+a1, a2+a3, b0+b1, b2+b3] in every 128-bit lane.
static inline __m512 hadd2(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of NP pairs of rows (q[2p], q[2p+1]) against keys 0 .. n-1, eight keys at a time: 8 NP
// accumulators, a key chunk in both halves of one register, a pair's query chunk in another.
// sc[r] gets row r's scores (up to 7 past n: room the caller left).
template <int NP, class Key>
static void pair_scores(const float *const *q, Key key, int n, int D, float *const *sc) {
    for (int s0 = 0; s0 < n; s0 += 8) {
        const kv_t *k8[8];
        for (int j = 0; j < 8; j++) k8[j] = key(s0 + j < n ? s0 + j : s0);  // past the last key: a dropped score
        __m512 a[NP][8];
        for (int p = 0; p < NP; p++)
            for (int j = 0; j < 8; j++) a[p][j] = _mm512_setzero_ps();
        for (int i = 0; i < D; i += 8) {
            __m512 qv[NP];
            for (int p = 0; p < NP; p++) qv[p] = halves(q[2 * p] + i, q[2 * p + 1] + i);
            for (int j = 0; j < 8; j++) {
                const __m512 kb = both_halves(k8[j] + i);
                for (int p = 0; p < NP; p++) a[p][j] = _mm512_fmadd_ps(qv[p], kb, a[p][j]);
            }
        }
        for (int p = 0; p < NP; p++)
            for (int j = 0; j < 8; j += 4) {  // attend_keys' reduction of four keys, in each half
                __m512 h = hadd2(hadd2(a[p][j], a[p][j + 1]), hadd2(a[p][j + 2], a[p][j + 3]));
                h = _mm512_add_ps(h, _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 3, 0, 1)));  // lane 0 + 1, 2 + 3
                _mm_storeu_ps(sc[2 * p] + s0 + j, _mm512_extractf32x4_ps(h, 0));
                _mm_storeu_ps(sc[2 * p + 1] + s0 + j, _mm512_extractf32x4_ps(h, 2));
            }
    }
}

// out[r][col .. col + 8 NC) = inv[r] sum_{j < n[r]} w[r][j] val(j) for the NP pairs of rows,
// keys in order: rows that see fewer keys than the pair's other row skip the rest (a masked FMA).
template <int NP, int NC, class Val>
static void pair_weigh(const float *const *w, const int *n, Val val, int col, const float *inv, float *const *out) {
    __m512 a[NP][NC];
    int lo = n[0], hi = n[0];
    for (int r = 1; r < 2 * NP; r++) lo = n[r] < lo ? n[r] : lo, hi = n[r] > hi ? n[r] : hi;
    for (int p = 0; p < NP; p++)
        for (int c = 0; c < NC; c++) a[p][c] = _mm512_setzero_ps();
    for (int j = 0; j < hi; j++) {
        const kv_t *v = val(j) + col;
        __m512 wp[NP];
        __mmask16 m[NP];
        for (int p = 0; p < NP; p++) {
            wp[p] = _mm512_mask_broadcastss_ps(_mm512_set1_ps(w[2 * p][j]), 0xFF00, _mm_load_ss(w[2 * p + 1] + j));
            m[p] = (__mmask16)((j < n[2 * p] ? 0x00FF : 0) | (j < n[2 * p + 1] ? 0xFF00 : 0));
        }
        for (int c = 0; c < NC; c++) {
            const __m512 vb = both_halves(v + 8 * c);
            for (int p = 0; p < NP; p++)
                a[p][c] = j < lo ? _mm512_fmadd_ps(wp[p], vb, a[p][c]) : _mm512_mask3_fmadd_ps(wp[p], vb, a[p][c], m[p]);
        }
    }
    for (int p = 0; p < NP; p++) {
        const __m512 s = _mm512_mask_broadcastss_ps(_mm512_set1_ps(inv[2 * p]), 0xFF00, _mm_load_ss(inv + 2 * p + 1));
        for (int c = 0; c < NC; c++) {
            const __m512 o = _mm512_mul_ps(a[p][c], s);
            _mm256_storeu_pd((double *)(out[2 * p] + col + 8 * c), _mm512_castpd512_pd256(_mm512_castps_pd(o)));
            _mm256_storeu_pd((double *)(out[2 * p + 1] + col + 8 * c), _mm512_extractf64x4_pd(_mm512_castps_pd(o), 1));
        }
    }
}

// NP pairs of rows of one head: rows r = 0 .. 2 NP - 1 at q[r], seeing keys 0 .. n[r]-1, their
// scores in sc[r] (n[r] + 8 floats each), their outputs to out[r].
template <int NP, class Key, class Val>
static void attend_pairs(const float *const *q, const int *n, Key key, Val val, int D, float *const *sc,
                         float *const *out) {
    int hi = n[0];
    for (int r = 1; r < 2 * NP; r++) hi = n[r] > hi ? n[r] : hi;
    pair_scores<NP>(q, key, hi, D, sc);
    float inv[2 * NP];
    for (int r = 0; r < 2 * NP; r++) inv[r] = softmax_weights(sc[r], n[r]);
    for (int i = 0; i < D;) {
        int left = (D - i) / 8;
        if (left >= 8) pair_weigh<NP, 8>(sc, n, val, i, inv, out), i += 64;
        else if (left >= 4) pair_weigh<NP, 4>(sc, n, val, i, inv, out), i += 32;
        else if (left >= 2) pair_weigh<NP, 2>(sc, n, val, i, inv, out), i += 16;
        else pair_weigh<NP, 1>(sc, n, val, i, inv, out), i += 8;
    }
}
#endif

// Rows 0 .. nq-1 (at most ROWS_AT_ONCE) of one head: row r's query at q + r ldq, its n[r] keys,
// its scores at scores + r lds (lds >= n[r] + 8), its output at out + r ldo. With AVX-512,
// rows two by two (`attend_pairs`), an odd last row alone; else each alone. The same numbers.
#define ROWS_AT_ONCE 6
template <class Key, class Val>
static void attend_rows(const float *q, long ldq, const int *n, int nq, Key key, Val val, int D, float *scores,
                        long lds, float *out, long ldo) {
    int r = 0;
#if defined(__AVX512F__)
    const float *qs[ROWS_AT_ONCE];
    float *sc[ROWS_AT_ONCE], *os[ROWS_AT_ONCE];
    for (int i = 0; i < nq; i++) qs[i] = q + i * ldq, sc[i] = scores + i * lds, os[i] = out + i * ldo;
    switch (nq / 2) {
    case 3: attend_pairs<3>(qs, n, key, val, D, sc, os), r = 6; break;
    case 2: attend_pairs<2>(qs, n, key, val, D, sc, os), r = 4; break;
    case 1: attend_pairs<1>(qs, n, key, val, D, sc, os), r = 2; break;
    }
#endif
    for (; r < nq; r++) attend_keys(q + r * ldq, key, val, n[r], D, scores + r * lds, out + r * ldo);
}

// Query rows t0 .. t0+nq-1 of a pass over one sequence: S past keys (a strided view of the slab,
// rows ps apart) and the pass's new keys 0 .. t (causal, rows ns apart): a token at position P
// always sees P + 1 keys, or in a local layer (window > 0) the last `window` of them. A row whose
// window leaves keys out is attended alone, from its first key: the same keys in the same order
// whatever pass holds it, so the same numbers.
static void attend_seq(const float *q, long ldq, const kv_t *pk, const kv_t *pv, long ps, const kv_t *nk,
                       const kv_t *nv, long ns, int S, int t0, int nq, int D, float *scores, long lds, float *out,
                       long ldo, int window) {
    auto key = [=](int s) { return s < S ? pk + (size_t)s * ps : nk + (size_t)(s - S) * ns; };
    auto val = [=](int s) { return s < S ? pv + (size_t)s * ps : nv + (size_t)(s - S) * ns; };
    int n[ROWS_AT_ONCE];
    for (int r = 0; r < nq; r++) n[r] = S + t0 + r + 1;
    if (!window || n[nq - 1] <= window) return attend_rows(q, ldq, n, nq, key, val, D, scores, lds, out, ldo);
    for (int r = 0; r < nq; r++) {
        const int lo = n[r] > window ? n[r] - window : 0;
        attend_keys(q + r * ldq, [=](int s) { return key(s + lo); }, [=](int s) { return val(s + lo); }, n[r] - lo, D,
                    scores + r * lds, out + r * ldo);
    }
}
