// One decode pass of a Smallem model (a Transformer or the MTP module) over T new tokens,
// reading its 16-bit weights as they lie in the checkpoint (`native.py` builds and loads it).
//
// Why: on a CPU a small model's one-token pass is bound by reading its weights. The target
// holds 36 MB of float32 weights, more than this machine's 32 MB L3, so every token reads
// them from DRAM; as float16 they are 18 MB, which stay in L3 from one token to the next.
// The checkpoints are float16, so computing with them (converted to float32 in registers,
// float32 accumulation) is the same model, with no rounding of its own.
//
// Same contract as the compiled graphs (`graphs.py`): the cache is only read (the past, a
// strided view of the slab), the new K/V come back in `out_new` [L, 2, Hkv, T, D] and the
// caller writes them. Every output row is computed the same way whatever T is (each sum
// in the same order), so a token's numbers do not depend on the pass that held it.
//
// Layout: weights in panels of eight output rows (below), rows of Wq/Wk permuted so that each
// rotary pair is two adjacent columns (`model.interleave_halves`), as the eager path's cache.
// One OpenMP region per pass; each product is split over output rows between the threads.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

// Every matrix W [out, in] is stored in panels of eight output rows (`native.panels`):
// float16 [ceil(out / 8), in, 8], so that a product reads each panel front to back.
struct LayerW {
    const uint16_t *qkv;  // [(H + 2Hkv) D, d]
    const uint16_t *o;    // [d, H D]
    const uint16_t *gu;   // [2F, d]: gate rows, then up rows
    const uint16_t *down; // [d, F]
    const float *g1, *g2; // RMSNorm weights before attention and before the MLP [d]
};

struct ModelW {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab;
    float eps;
    const LayerW *layers;
    const uint16_t *embed; // [V, d] row-major (a Transformer's token embedding; unused by the MTP module)
    const uint16_t *head;  // [V, d] output head, or null (no head: the MTP module)
    const float *g_final;  // [d] final norm, or null
    // The MTP module's prologue: x = table[token] + (unit_rms(h) * g_h) @ Wh^T
    const float *table;    // [V, d] float32 (the token's half, `MTPModule.token_table`), or null
    const uint16_t *wh;    // [d, d] the h half of eh_proj
    const float *g_h;      // [d]
};

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

// y[m, n] (+)= sum_k x[m, k] W[n, k] for m < M, n < N, with W in panels of eight output
// columns (`native.panels`): wp[(n / 8) K + k][n % 8], float16, the last panel padded.
//
// A tile holds MR input rows x NV panels in 12 accumulators (16 registers: 12 + the panels
// or the broadcast inputs + one temporary): each k adds x[m, k] * W[n .. n+8, k] to every
// one of them, one FMA per accumulator, no horizontal sums at the end. Every output is one
// float32 sum over k = 0 .. K-1 in order, whatever tile holds it: a token's numbers do not
// depend on how many rows the pass has.
#define ACC12(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
template <int MR, int NV>
static inline void tile(const float *x, int ldx, const uint16_t *wp, int K, float *y, int ldy, int n, int N,
                        bool add) {
    static_assert(MR * NV <= 12 && MR >= 1 && NV >= 1, "at most 12 accumulators");
    const __m256 z = _mm256_setzero_ps();
#define DECL(i) __m256 c##i = z;
    ACC12(DECL)
#undef DECL
    const uint16_t *p = wp + (size_t)(n / 8) * K * 8;  // panel n / 8; panel v of the tile at p + v K 8
    for (int k = 0; k < K; k++, p += 8, x++) {
        // Several rows read the panels at the pace of their arithmetic, too slowly for the
        // hardware's prefetcher: each panel's line 4 KB ahead is asked for as this one is read
        // (4 KB read best of 0.25 to 16 KB; one row reads fast enough without)
        if constexpr (MR > 1)
            if ((k & 3) == 0)
                for (int v = 0; v < NV; v++) _mm_prefetch((const char *)(p + (size_t)v * K * 8 + 2048), _MM_HINT_T0);
        if constexpr (MR >= 4) {  // NV <= 3 panels in registers, one broadcast input at a time
            __m256 w[NV], b;
            for (int v = 0; v < NV; v++) w[v] = load_h(p + (size_t)v * K * 8);
#define FMA(i) if constexpr (i < MR * NV) { if constexpr (i % NV == 0) b = _mm256_broadcast_ss(x + (size_t)(i / NV) * ldx); \
                                             c##i = _mm256_fmadd_ps(b, w[i % NV], c##i); }
            ACC12(FMA)
#undef FMA
        } else {  // MR <= 3 inputs in registers, one panel at a time
            __m256 b[MR], w;
            for (int m = 0; m < MR; m++) b[m] = _mm256_broadcast_ss(x + (size_t)m * ldx);
#define FMA(i) if constexpr (i < MR * NV) { if constexpr (i % MR == 0) w = load_h(p + (size_t)(i / MR) * K * 8); \
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
template <int MR, int NV>
static inline void tiles(const float *x, int ldx, const uint16_t *wp, int K, float *y, int ldy, int n0, int np, int N,
                         bool add) {
    int v = 0;
    for (; v + NV <= np; v += NV) tile<MR, NV>(x, ldx, wp, K, y, ldy, n0 + 8 * v, N, add);
    if constexpr (NV > 1)
        if (np - v > 0) tiles<MR, NV - 1>(x, ldx, wp, K, y, ldy, n0 + 8 * v, np - v, N, add);
}

// Every input row against the np panels of one chunk (wp: its first panel, y: its first
// column, N: the real columns from there on): rows in groups of six, then the rest (7 = 4 + 3
// and 8 = 4 + 4 rows, so that no group has one or two).
static void rows_against(const float *x, int M, int ldx, const uint16_t *wp, int K, float *y, int ldy, int np, int N,
                         bool add) {
    int m = 0;
    for (; M - m >= 6 && M - m != 7 && M - m != 8; m += 6)
        tiles<6, 2>(x + (size_t)m * ldx, ldx, wp, K, y + (size_t)m * ldy, ldy, 0, np, N, add);
    while (m < M) {
        const float *xm = x + (size_t)m * ldx;
        float *ym = y + (size_t)m * ldy;
        switch (M - m) {
        case 5: tiles<5, 2>(xm, ldx, wp, K, ym, ldy, 0, np, N, add); m += 5; break;
        case 3: tiles<3, 4>(xm, ldx, wp, K, ym, ldy, 0, np, N, add); m += 3; break;
        case 2: tiles<2, 6>(xm, ldx, wp, K, ym, ldy, 0, np, N, add); m += 2; break;
        case 1: tiles<1, 12>(xm, ldx, wp, K, ym, ldy, 0, np, N, add); m += 1; break;
        default: tiles<4, 3>(xm, ldx, wp, K, ym, ldy, 0, np, N, add); m += 4; break;  // 4, 7 or 8 rows
        }
    }
}

// Called inside the parallel region by every thread: each takes an equal share of the panels
// (whole panels, so no `omp for`), in chunks of 12 that every row group reads while they sit
// in L2, then a barrier.
static void matmul(const float *x, int M, int ldx, const uint16_t *wp, int N, int K, float *y, int ldy, bool add) {
    const int panels = (N + 7) / 8, nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int v0 = (int)((long)panels * me / nt), v1 = (int)((long)panels * (me + 1) / nt);
    for (int c = v0; c < v1; c += 12) {
        const int np = v1 - c < 12 ? v1 - c : 12;
        rows_against(x, M, ldx, wp + (size_t)c * K * 8, K, y + 8 * c, ldy, np, N - 8 * c, add);
    }
#pragma omp barrier
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

// out[0 .. NB*8) = sum_j p[j] v_j over n rows v_j (past rows at stride ps, then new rows at
// stride ns): NB accumulators in registers, so the adds of one row do not wait on each other.
template <int NB>
static inline void weigh_rows(const float *p, int n, const float *pv, long ps, const float *nv, long ns, int S,
                              float inv, float *out) {
    __m256 a[NB];
    for (int b = 0; b < NB; b++) a[b] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        const float *v = j < S ? pv + (size_t)j * ps : nv + (size_t)(j - S) * ns;
        __m256 w = _mm256_set1_ps(p[j]);
        for (int b = 0; b < NB; b++) a[b] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * b), a[b]);
    }
    for (int b = 0; b < NB; b++) _mm256_storeu_ps(out + 8 * b, _mm256_mul_ps(a[b], _mm256_set1_ps(inv)));
}

// Attention of query row t, head h, over S past keys (a strided view of the slab) and the
// pass's new keys 0..t (causal), softmax in float32. q is pre-scaled; out [D].
// Every score is summed the same way (four keys at a time, each its own sum, reduced by the
// same pairwise adds), and a token at position P always sees P + 1 keys: its numbers do not
// depend on the pass that holds it.
static void attend_one(const float *q, const float *pk, const float *pv, long ps, const float *nk, const float *nv,
                       long ns, int S, int t, int D, float *scores, float *out) {
    const int n = S + t + 1;
    float mx = -INFINITY;
    for (int s0 = 0; s0 < n; s0 += 4) {
        const float *k4[4];
        for (int j = 0; j < 4; j++) {  // past the last key: q itself, a valid row whose score is dropped
            int s = s0 + j;
            k4[j] = s >= n ? q : s < S ? pk + (size_t)s * ps : nk + (size_t)(s - S) * ns;
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
        if (left >= 8) weigh_rows<8>(scores, n, pv + i, ps, nv + i, ns, S, inv, out + i), i += 64;
        else if (left >= 4) weigh_rows<4>(scores, n, pv + i, ps, nv + i, ns, S, inv, out + i), i += 32;
        else if (left >= 2) weigh_rows<2>(scores, n, pv + i, ps, nv + i, ns, S, inv, out + i), i += 16;
        else weigh_rows<1>(scores, n, pv + i, ps, nv + i, ns, S, inv, out + i), i += 8;
    }
}

// Scratch per pass: sized by the caller (`NativeSteps._need`).
//   xn [T, d], y [T, (H+2Hkv) D], att [T, H D], gu [T, 2F], hf [T, F], scores [threads, S + T]
//
// past: [L, 2, Hkv, S, D] with element strides past_st[0..3] of its first four dims (D's is 1);
// cos, sin [T, P] with P = (H + 2Hkv) D / 2: each adjacent column pair of the QKV row turns.
// tokens [T]; h [T, d] (the MTP module's input, else null); x [T, d] output: the hidden states
// (every row; the caller keeps the last one for `last`); logits [T_head, V] of the last
// T_head rows when the model has a head and T_head > 0; out_new [L, 2, Hkv, T, D];
// top [T_head + 1] (or null): each logits row's argmax, then 1 if every logit is finite, else 0
// (what a greedy verification reads, without a pass of its own over the logits).
extern "C" void smallem_step(const ModelW *mw, const int64_t *tokens, const float *h, int T, const float *cos_t,
                  const float *sin_t, const float *past, const int64_t *past_st, int S, float *x, float *logits,
                  int T_head, float *out_new, float *scratch, int threads, int64_t *top) {
    int finite = 1;
    const int d = mw->dim, H = mw->n_heads, Hkv = mw->n_kv_heads, D = mw->head_dim, F = mw->hidden;
    const int G = H / Hkv, Q = (H + 2 * Hkv) * D, P = Q / 2;
    float *xn = scratch, *y = xn + (size_t)T * d, *att = y + (size_t)T * Q, *gu = att + (size_t)T * H * D;
    float *hf = gu + (size_t)T * 2 * F, *scores = hf + (size_t)T * F;
    const float qscale = 1.0f / sqrtf((float)D);

#pragma omp parallel num_threads(threads)
    {
        // embedding: a Transformer's token rows (float16), or the MTP module's prologue
        if (mw->table) {
            rms_rows(h, T, d, mw->eps, mw->g_h, xn);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) memcpy(x + (size_t)t * d, mw->table + (size_t)tokens[t] * d, d * sizeof(float));
            matmul(xn, T, d, mw->wh, d, d, x, d, true);
        } else {
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                const uint16_t *e = mw->embed + (size_t)tokens[t] * d;
                for (int i = 0; i < d; i += 8) _mm256_storeu_ps(x + (size_t)t * d + i, load_h(e + i));
            }
        }
        for (int l = 0; l < mw->n_layers; l++) {
            const LayerW &L = mw->layers[l];
            rms_rows(x, T, d, mw->eps, L.g1, xn);
            matmul(xn, T, d, L.qkv, Q, d, y, Q, false);
            // rotary turn of each adjacent pair (v's pairs turn by 0), the attention scale on q,
            // and the new K/V out: [2, Hkv, T, D] of this layer
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *r = y + (size_t)t * Q;
                const float *c = cos_t + (size_t)t * P, *sn = sin_t + (size_t)t * P;
                for (int p = 0; p < P; p++) {
                    float a = r[2 * p], b = r[2 * p + 1];
                    r[2 * p] = a * c[p] - b * sn[p];
                    r[2 * p + 1] = a * sn[p] + b * c[p];
                }
                for (int i = 0; i < H * D; i++) r[i] *= qscale;
                for (int kv = 0; kv < 2; kv++)
                    for (int g = 0; g < Hkv; g++)
                        memcpy(out_new + ((((size_t)l * 2 + kv) * Hkv + g) * T + t) * D, r + (H + kv * Hkv + g) * D,
                               D * sizeof(float));
            }
            const float *pl = past + (size_t)l * past_st[0];
            const float *nl = out_new + (size_t)l * 2 * Hkv * T * D;
#pragma omp for schedule(static)
            for (int i = 0; i < H * T; i++) {
                int hh = i / T, t = i % T, g = hh / G;
                const float *pk = pl + (size_t)g * past_st[2], *pv = pk + past_st[1];
                const float *nk = nl + (size_t)g * T * D, *nv = nl + ((size_t)Hkv + g) * T * D;
                attend_one(y + (size_t)t * Q + hh * D, pk, pv, past_st[3], nk, nv, D, S, t, D,
                           scores + (size_t)omp_get_thread_num() * (S + T), att + (size_t)t * H * D + hh * D);
            }
            matmul(att, T, H * D, L.o, d, H * D, x, d, true);
            rms_rows(x, T, d, mw->eps, L.g2, xn);
            matmul(xn, T, d, L.gu, 2 * F, d, gu, 2 * F, false);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                const float *a = gu + (size_t)t * 2 * F, *b = a + F;
                float *o = hf + (size_t)t * F;
                for (int i = 0; i < F; i += 8) {
                    __m256 av = _mm256_loadu_ps(a + i);
                    __m256 sg = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                              _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), av))));
                    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(av, sg), _mm256_loadu_ps(b + i)));
                }
            }
            matmul(hf, T, F, L.down, d, F, x, d, true);
        }
        if (mw->head && T_head > 0) {
            rms_rows(x + (size_t)(T - T_head) * d, T_head, d, mw->eps, mw->g_final, xn);
            matmul(xn, T_head, d, mw->head, mw->vocab, d, logits, mw->vocab, false);
            if (top) {
#pragma omp for schedule(static)
                for (int t = 0; t < T_head; t++) {
                    bool ok;
                    top[t] = argmax_finite(logits + (size_t)t * mw->vocab, mw->vocab, &ok);
                    if (!ok) {
#pragma omp atomic write
                        finite = 0;
                    }
                }
            }
        }
    }
    if (top && mw->head && T_head > 0) top[T_head] = finite;
}


// A proposer's chain of k guesses in one call (for the MTP module as `chain.MTPChain` and
// `MTPSampledChain`): the head picks guess 1 from h0 (the model's state after its catch-up),
// then each further guess feeds the last one back through the model at the next position:
// the MTP module reads its own last state with it, a draft its token alone. The chained
// entries' K/V are written into `view` at positions L, L+1, .. (the caller reserved them; the
// MTP module drops them after the round, a draft keeps those the target confirms), so that
// each step reads them as past.
//   head_rows: N rows of d, in panels (the proposer's head: maybe cut to N rows; `ids` [N] maps a
//   row to its token, null: row = token), g_final [d] the final norm; cos, sin [k-1, P];
//   view: the model's cache [layers, 2, Hkv, >= L+k-1, D] with strides st[0..3].
//   Greedy (u null): tokens [k] the head's argmax, tops [k] its probability (for p-min).
//   Sampled: q_j = softmax(logits_j * inv_t) into q [k, N], or with `ids` into q [k, V] (zeroed by
//   the caller: a cut head's q is zero outside its tokens), and guess j by the inverse CDF on
//   the uniform draw u [j] made by the caller from the run's generator (`verify.pick`: the
//   first token whose running sum of q_j, in float64 and in order, exceeds u_j times the total).
// scratch: smallem_step's for T=1 (step_scratch floats), then 3 d + layers 2 Hkv D + N floats.
extern "C" void smallem_chain(const ModelW *mw, const uint16_t *head_rows, int N, const float *g_final,
                              const int64_t *ids, const float *h0, int k, const float *cos_t, const float *sin_t,
                              float *view, const int64_t *st, int L, const double *u, float inv_t, int64_t *tokens,
                              float *tops, float *q, float *scratch, int step_scratch, int threads) {
    const int d = mw->dim, Hkv = mw->n_kv_heads, D = mw->head_dim, P = (mw->n_heads + 2 * Hkv) * D / 2;
    const int NL = mw->n_layers;
    float *state = scratch + step_scratch, *next = state + d, *xn = next + d, *nw = xn + d;
    float *logits = nw + (size_t)NL * 2 * Hkv * D;
    memcpy(state, h0, d * sizeof(float));
    for (int j = 0; j < k; j++) {
#pragma omp parallel num_threads(threads)
        {
            rms_rows(state, 1, d, mw->eps, g_final, xn);
            matmul(xn, 1, d, head_rows, N, d, logits, N, false);
        }
        int best = 0;
        for (int i = 1; i < N; i++)
            if (logits[i] > logits[best]) best = i;
        if (u) {  // q = softmax(logits / T), then the inverse CDF at u_j
            // q_j over the vocabulary: row i of a cut head is token ids[i]'s column
            float *qj = q + (size_t)j * (ids ? mw->vocab : N);
            auto col = [&](int i) { return ids ? ids[i] : (int64_t)i; };
            const float top = logits[best] * inv_t;
            float sum = 0.0f;
            for (int i = 0; i < N; i++) {
                float e = expf(logits[i] * inv_t - top);
                qj[col(i)] = e;
                sum += e;
            }
            const float inv = 1.0f / sum;
            double total = 0.0;
            for (int i = 0; i < N; i++) {
                qj[col(i)] *= inv;
                total += qj[col(i)];
            }
            const double v = u[j] * total;
            double run = 0.0;
            best = N - 1;  // v rounded up to the total: the last
            for (int i = 0; i < N; i++) {
                run += qj[col(i)];
                if (run > v) {
                    best = i;
                    break;
                }
            }
            tops[j] = qj[col(best)];
        } else {
            float sum = 0.0f;
            for (int i = 0; i < N; i++) sum += expf(logits[i] - logits[best]);
            tops[j] = 1.0f / sum;
        }
        tokens[j] = ids ? ids[best] : best;
        if (j == k - 1) break;
        int64_t tok = tokens[j];
        smallem_step(mw, &tok, mw->table ? state : nullptr, 1, cos_t + (size_t)j * P, sin_t + (size_t)j * P, view, st,
                     L + j, next, nullptr, 0, nw, scratch, threads, nullptr);
        for (int l = 0; l < NL; l++)  // this step's K/V into the cache, where the next step reads them
            for (int kv = 0; kv < 2; kv++)
                for (int g = 0; g < Hkv; g++)
                    memcpy(view + l * st[0] + kv * st[1] + g * st[2] + (size_t)(L + j) * st[3],
                           nw + (((size_t)l * 2 + kv) * Hkv + g) * D, D * sizeof(float));
        memcpy(state, next, d * sizeof(float));
    }
}

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
        const float top = mx * inv_t;
        __m256 vt = _mm256_set1_ps(top), vi = _mm256_set1_ps(inv_t), acc = _mm256_setzero_ps();
        for (i = 0; i + 8 <= V; i += 8) {
            __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(l + i), vi, vt));
            _mm256_storeu_ps(r + i, e);
            acc = _mm256_add_ps(acc, e);
        }
        float sum = hsum(acc);
        for (; i < V; i++) sum += (r[i] = expf(l[i] * inv_t - top));
        return sum;
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
