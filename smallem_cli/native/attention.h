// Attention of one query row over the keys it sees: a sequence's past and new keys, or a paged batch's slots.
#pragma once

#include "vec.h"

// out[0 .. NB*8) = sum_j p[j] v_j over n rows v_j = row(j) (offset by the caller to the columns
// wanted): NB accumulators in registers, so the adds of one row do not wait on each other.
template <int NB, class Row>
static inline void weigh_rows(const float *p, int n, Row row, int col, float inv, float *out) {
    __m256 a[NB];
    for (int b = 0; b < NB; b++) a[b] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *v = row(j) + col;
        __m256 w = _mm256_set1_ps(p[j]);
        for (int b = 0; b < NB; b++) a[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * b), a[b]);
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out + 8 * b, _mm256_mul_ps(a[b], _mm256_set1_ps(inv)));
}

// Attention of one query row over n keys key(0 .. n-1) and their values val(j), softmax in
// float32. q is pre-scaled; out [D]. Every score is summed the same way (four keys at a
// time, each its own sum, reduced by the same pairwise adds), so a row that sees the same
// keys in the same order gets the same numbers, whatever pass holds it and however its keys
// are addressed (a strided view of one sequence, or slots of a paged batch).
template <class Key, class Val>
static void attend_keys(const float *q, Key key, Val val, int n, int D, float *scores, float *out) {
    float mx = -INFINITY;
    for (int s0 = 0; s0 < n; s0 += 4) {
        const float *k4[4];
        for (int j = 0; j < 4; j++) {  // past the last key: q itself, a valid row whose score is dropped
            int s = s0 + j;
            k4[j] = s >= n ? q : key(s);
        }
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int i = 0; i < D; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4[0] + i), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4[1] + i), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4[2] + i), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4[3] + i), a3);
        }
        __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        float four[4];
        _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
        for (int j = 0; j < 4 && s0 + j < n; j++) {
            scores[s0 + j] = four[j];
            mx = four[j] > mx ? four[j] : mx;
        }
    }
    __m256 vm = _mm256_set1_ps(mx), tot = _mm256_setzero_ps();
    int s = 0;
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
    const float inv = 1.0f / sum;
    for (int i = 0; i < D;) {  // up to 64 columns at a time, each in its own register
        int left = (D - i) / 8;
        if (left >= 8) weigh_rows<8>(scores, n, val, i, inv, out + i), i += 64;
        else if (left >= 4) weigh_rows<4>(scores, n, val, i, inv, out + i), i += 32;
        else if (left >= 2) weigh_rows<2>(scores, n, val, i, inv, out + i), i += 16;
        else weigh_rows<1>(scores, n, val, i, inv, out + i), i += 8;
    }
}

// Query row t of a pass over one sequence: S past keys (a strided view of the slab, rows ps
// apart) and the pass's new keys 0 .. t (causal, rows ns apart): a token at position P always
// sees P + 1 keys.
static void attend_one(const float *q, const float *pk, const float *pv, long ps, const float *nk, const float *nv,
                       long ns, int S, int t, int D, float *scores, float *out) {
    auto key = [=](int s) { return s < S ? pk + (size_t)s * ps : nk + (size_t)(s - S) * ns; };
    auto val = [=](int s) { return s < S ? pv + (size_t)s * ps : nv + (size_t)(s - S) * ns; };
    attend_keys(q, key, val, S + t + 1, D, scores, out);
}
