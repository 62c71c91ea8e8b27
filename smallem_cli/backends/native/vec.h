// Small vector helpers of the native engine (AVX2, F16C, FMA).
#pragma once

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

// float32 exp, vectorised (Cephes' polynomial, as in avx_mathfun): about 1 ulp.
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// out[i] = exp(x[i] scale - shift) for i < n (out may be x) -> their sum: a softmax's weights,
// shift being the largest x times scale, so that none overflows.
static inline float exp_sum(const float *x, float *out, int n, float scale, float shift) {
    const __m256 vs = _mm256_set1_ps(scale), vt = _mm256_set1_ps(shift);
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(x + i), vs, vt));
        _mm256_storeu_ps(out + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum(acc);
    for (; i < n; i++) sum += (out[i] = expf(x[i] * scale - shift));
    return sum;
}

// The first index of the largest of x[0 .. n) (torch.argmax's choice), and whether every
// value is finite: x - x is NaN exactly where x is NaN or infinite.
static inline int64_t argmax_finite(const float *x, int n, bool *finite) {
    __m256 mx = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        mx = _mm256_max_ps(mx, v);
    }
    float m[8], top = -INFINITY;
    _mm256_storeu_ps(m, mx);
    for (int j = 0; j < 8; j++) top = m[j] > top ? m[j] : top;
    bool ok = _mm256_movemask_ps(bad) == 0;
    for (; i < n; i++) {
        ok = ok && x[i] - x[i] == 0.0f;
        top = x[i] > top ? x[i] : top;
    }
    *finite = ok;
    for (i = 0; i < n; i++)
        if (x[i] == top) return i;
    return 0;  // no value equals the largest: a NaN row (not finite)
}

static inline __m256 load_h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
// Eight bfloat16 -> float32: a bfloat16 is a float32's upper half, so this is exact.
static inline __m256 load_b(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float bf16_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// The K/V cache holds float16 (`native.KV_DTYPE`): half the bytes a batch's attention
// streams through, which bounds it once many sequences each read their own keys (every row's
// keys are read once a pass; nothing is reused between rows). Values are rounded to the nearest
// float16 when written, read back exactly; the eager path rounds them the same way.
typedef uint16_t kv_t;
static inline __m256 kv_load8(const kv_t *p) { return load_h(p); }
// d[0 .. n) = s[0 .. n) rounded to float16, n a multiple of 8.
static inline void kv_store(kv_t *d, const float *s, int n) {
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
}
