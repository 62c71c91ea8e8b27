// Speculative sampling's rule over one sequence's raw logits, in one call (`native.verify_sample`).
#pragma once

#include <algorithm>

#include "vec.h"

// The filters of `verify.warp` beside the temperature, on one row's unnormalised weights
// r[i] = exp(x_i - max) (x = logits inv_t) of sum `sum` -> the new sum; a token dropped gets
// r[i] = 0. top_k (0: off): the top_k largest logits stay (ties at the last place in token
// order); top_p (>= 1: off): most probable first, a token stays while the probability of
// those before it sums to less than top_p (the top one always; among equal ones, token
// order); min_p (0: off): a token below min_p times the top probability goes. Each as `warp`
// orders them: top-k on the logits, then the softmax, top-p on it, then min-p. The sort of
// top-p first looks at the 256, then 2,048 most probable (as `verify._nucleus`). `tmp`: V
// floats, `idx`: V ints of scratch.
static float filter_row(const float *l, float *r, int V, float sum, int top_k, float top_p, float min_p, float *tmp,
                        int *idx) {
    if (top_k > 0 && top_k < V) {
        memcpy(tmp, l, V * sizeof(float));
        std::nth_element(tmp, tmp + (top_k - 1), tmp + V, [](float a, float b) { return a > b; });
        const float thr = tmp[top_k - 1];
        int above = 0;
        for (int i = 0; i < V; i++) above += l[i] > thr;
        int ties = top_k - above;  // places left for logits equal to the threshold
        sum = 0.0f;
        for (int i = 0; i < V; i++) {
            if (l[i] < thr || (l[i] == thr && ties-- <= 0)) r[i] = 0.0f;
            sum += r[i];
        }
    }
    if (top_p < 1.0f) {
        const float inv = 1.0f / sum;
        int m = 0;
        for (int i = 0; i < V; i++)
            if (r[i] > 0.0f) idx[m++] = i;
        auto more = [&](int a, int b) { return r[a] > r[b] || (r[a] == r[b] && a < b); };
        int head = 0;  // the sorted prefix idx[0 .. head) holds mass >= top_p, or is all of them
        for (int h : {256, 2048, m}) {
            h = std::min(h, m);
            std::partial_sort(idx, idx + h, idx + m, more);
            float run = 0.0f;
            for (int i = 0; i < h; i++) run += r[idx[i]] * inv;
            head = h;
            if (run >= top_p || h == m) break;
        }
        float before = 0.0f;  // the probability of the more probable tokens left in so far
        int keep = 0;
        while (keep < head && (keep == 0 || before < top_p)) before += r[idx[keep++]] * inv;
        for (int i = keep; i < m; i++) r[idx[i]] = 0.0f;
        sum = 0.0f;
        for (int i = 0; i < V; i++) sum += r[i];
    }
    if (min_p > 0.0f) {
        float top = 0.0f;
        for (int i = 0; i < V; i++) top = r[i] > top ? r[i] : top;
        const float cut = min_p * (top / sum);
        float left = 0.0f;
        for (int i = 0; i < V; i++) {
            if (r[i] / sum < cut) r[i] = 0.0f;
            left += r[i];
        }
        sum = left;
    }
    return sum;
}

// Speculative sampling's verification of one sequence, as `verify.verify_sample` after
// `verify.warp` (the same draws from the same uniforms): draft token j is accepted when
// u[j] q[j, x_j] < p_j(x_j), p_j = softmax(logits_j inv_t) filtered (`filter_row`); at the
// first one rejected, n, the next token is drawn from max(0, p_n - q_n) (from p_n if that
// is all zero), and after k accepted from p_k, by the inverse CDF on u_next (`verify.sample`:
// float64 running sums in token order). logits [k+1, V], drafts [k], q [k, V] (null when
// k = 0), u [k] float32, u_next [1] float64; r: 3 V floats of scratch. out [k + 2]: n, then
// the k+1 tokens (the draft tokens with the drawn token at n; the ones after it to be ignored).
extern "C" void smallem_verify_sample(const float *logits, int k, int V, float inv_t, const int64_t *drafts,
                                      const float *q, const float *u, const double *u_next, float *r, int64_t *out,
                                      int top_k, float top_p, float min_p) {
    float *tmp = r + V;
    int *idx = (int *)(r + 2 * (size_t)V);
    // r = the filtered exp(logits_j inv_t - max) over the row -> its sum (p_j = r / sum)
    auto weights = [&](int j) {
        const float *l = logits + (size_t)j * V;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        int i = 0;
        for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(l + i));
        float m[8], mx = -INFINITY;
        _mm256_storeu_ps(m, m8);
        for (int j = 0; j < 8; j++) mx = m[j] > mx ? m[j] : mx;
        for (; i < V; i++) mx = l[i] > mx ? l[i] : mx;
        const float sum = exp_sum(l, r, V, inv_t, mx * inv_t);
        return top_k > 0 || top_p < 1.0f || min_p > 0.0f ? filter_row(l, r, V, sum, top_k, top_p, min_p, tmp, idx) : sum;
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

// CTRL's repetition penalty on one logit of a token in the context (`verify._repeated`): divided
// by the penalty when positive, multiplied by it when not.
static inline float repeated(float x, float penalty) { return x > 0.0f ? x / penalty : x * penalty; }

// The repetition penalty (`verify.penalize`) over the rows of one sequence's pass, in place, and
// each penalised row's argmax: logits [T, V], row t predicting the token after fed[t]; its
// context is seen [V] (bytes, 1: in the context before the pass) plus fed[0 .. t]. A token of
// it has its logit divided by the penalty when positive, multiplied by it when not: the same
// float32 operations as torch's, so the same numbers. top [T]: the first index of each row's
// largest (torch.argmax's choice). mark: V bytes of scratch.
extern "C" void smallem_penalize(float *logits, int T, int V, const uint8_t *seen, const int64_t *fed, float penalty,
                                 int64_t *top, uint8_t *mark) {
    memcpy(mark, seen, V);
    for (int t = 0; t < T; t++) {
        mark[fed[t]] = 1;
        float *l = logits + (size_t)t * V;
        for (int i = 0; i < V; i++)
            if (mark[i]) l[i] = repeated(l[i], penalty);
        bool finite;
        top[t] = argmax_finite(l, V, &finite);
    }
}
