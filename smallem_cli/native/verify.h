// Speculative sampling's rule over one sequence's raw logits, in one call (`native.verify_sample`).
#pragma once

#include "vec.h"

// Speculative sampling's verification of one sequence under a plain temperature, as
// `verify.verify_sample` after `verify.warp` (the same draws from the same uniforms): guess j
// is kept when u[j] q[j, x_j] < p_j(x_j), p_j = softmax(logits_j inv_t); at the first guess
// kept not, n, the next token is drawn from max(0, p_n - q_n) (from p_n if that is all zero),
// and after k kept from p_k, by the inverse CDF on u_next (`verify.pick`: float64 running sums
// in token order). logits [k+1, V], drafts [k], q [k, V] (null when k = 0), u [k] float32,
// u_next [1] float64; r: V floats of scratch. out [k + 2]: n, then the k+1 tokens (the guesses
// with the drawn token at n; the ones after it to be ignored).
extern "C" void smallem_verify_sample(const float *logits, int k, int V, float inv_t, const int64_t *drafts,
                                      const float *q, const float *u, const double *u_next, float *r, int64_t *out) {
    // r = exp(logits_j inv_t - max) over the row -> its sum (p_j = r / sum)
    auto weights = [&](int j) {
        const float *l = logits + (size_t)j * V;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        int i = 0;
        for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(l + i));
        float m[8], mx = -INFINITY;
        _mm256_storeu_ps(m, m8);
        for (int j = 0; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
        for (; i < V; i++) mx = l[i] > mx ? l[i] : mx;
        return exp_sum(l, r, V, inv_t, mx * inv_t);
    };
    int n = 0;
    float sum = 0.0f;
    for (; n <= k; n++) {
        sum = weights(n);
        if (n == k || !(u[n] * q[(size_t)n * V + drafts[n]] < r[drafts[n]] / sum)) break;
    }
    const float inv = 1.0f / sum;
    double total = 0.0;
    for (int i = 0; i < V; i++) {
        float p = r[i] * inv;
        r[i] = n < k ? (p - q[(size_t)n * V + i] > 0.0f ? p - q[(size_t)n * V + i] : 0.0f) : p;
        total += r[i];
    }
    if (!(total > 0.0)) {  // p_n == q_n to rounding: draw from p_n
        weights(n);
        total = 0.0;
        for (int i = 0; i < V; i++) total += (r[i] *= inv);
    }
    const double v = u_next[0] * total;
    double run = 0.0;
    int64_t next = V - 1;  // v rounded up to the total: the last
    for (int i = 0; i < V; i++) {
        run += r[i];
        if (run > v) {
            next = i;
            break;
        }
    }
    out[0] = n;
    for (int j = 0; j < k; j++) out[1 + j] = drafts[j];
    out[1 + n] = next;
}
