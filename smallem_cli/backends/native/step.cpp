// One decode pass of a Smallem model (a Transformer or the MTP module) over T new tokens,
// reading its weights as the model holds them (`native/__init__.py` builds and loads it).
//
// Why: on a CPU a small model's one-token pass is bound by reading its weights. The family's
// target holds 36 MB of float32 weights, more than this machine's 32 MB L3, so every token reads
// them from DRAM; as float16 they are 18 MB, which stay in L3 from one token to the next. Each
// matrix is read in the narrowest type that holds its values exactly (float16, bfloat16, else
// float32: `native.narrowest`), converted to float32 in registers and accumulated in float32:
// the same model, with no rounding of its own but the K/V cache's float16 (vec.h), as the eager path's.
// A quantized file's matrices are the exception: integer products against inputs rounded to int16
// per block (qmatmul.h).
//
// The past is read as a strided view of the slab;
// the new K/V go to `out_new` [L, 2, Hkv, T, D]: the slab itself, right after the past (the
// positions the caller reserved), or a buffer. Every output row is computed the same way
// whatever T is (each sum in the same order), so a token's numbers do not depend on the pass
// that held it.
//
// Layout: weights in panels of PANEL output rows (below, matmul.h), rows of Wq/Wk permuted so that each
// rotary pair is two adjacent columns (`weights.interleave_halves`), as the eager path's cache.
// One OpenMP region per pass; each product is split over output rows between the threads.

#include "attention.h"
#include "matmul.h"
#include "vec.h"
#include "verify.h"  // smallem_verify_sample: one library, one translation unit (one compile)

// Every matrix W [out, in] is stored in panels of PANEL output rows (`native.panels`):
// [ceil(out / PANEL), in, PANEL], so that a product reads each panel front to back; float16,
// bfloat16 or float32, or a proposer's int8 with its rows' scales (`Mat`, matmul.h).

// The panel width this library was built for (16 with AVX-512, else 8): the packing must match.
extern "C" int smallem_panel() { return PANEL; }
// Rows of attention scores each thread's scratch holds (`pass`): the caller sizes it.
extern "C" int smallem_score_rows() { return ROWS_AT_ONCE; }
struct LayerW {
    Mat qkv;  // [(H + 2Hkv) D, d]
    Mat o;    // [d, H D]
    Mat gu;   // [2F, d]: gate rows, then up rows
    Mat down; // [d, F]
    const float *g1, *g2; // RMSNorm weights before attention and before the MLP [d]
    const float *bias;    // [(H + 2Hkv) D] q, k, v biases in the row's order (Qwen2's), or null
    const float *gq, *gk; // [D] RMSNorm weights of each q head and each k head before rope (Qwen3's), or null
    const float *g3, *g4; // [d] RMSNorm weights of the attention's output and the MLP's (Gemma's), or null
    int window;           // a local layer's keys, its own included (Gemma's sliding window), or 0: all; it turns by
                          // the local rotary tables (`ModelW.rope_local`)
};

// A head's RMSNorm in place (`Block.project`'s q and k norms): r [D] times g [D].
static inline void head_norm(float *r, int D, float eps, const float *g) {
    __m256 s = _mm256_setzero_ps();
    for (int i = 0; i < D; i += 8) {
        __m256 v = _mm256_loadu_ps(r + i);
        s = _mm256_fmadd_ps(v, v, s);
    }
    const float inv = 1.0f / sqrtf(hsum(s) / D + eps);
    for (int i = 0; i < D; i++) r[i] = r[i] * inv * g[i];
}

struct ModelW {
    int n_layers, dim, n_heads, n_kv_heads, head_dim, hidden, vocab;
    float eps;
    const LayerW *layers;
    const void *embed;     // [V, d] row-major, or in panels [V / PANEL, d, PANEL] (`embed_panels`), `embed_kind`
                           // (a Transformer's token embedding; not the MTP module's)
    Mat head;              // [V, d] output head, or w null (no head: the MTP module)
    const float *g_final;  // [d] final norm, or null
    // The MTP module's prologue: x = table[token] + (unit_rms(h) * g_h) @ Wh^T
    const float *table;    // [V, d] float32 (the token's half, `MTPModule.token_table`), or null
    Mat wh;                // [d, d] the h half of eh_proj
    const float *g_h;      // [d]
    int embed_kind;        // W_F16, W_BF16, W_F32, or W_Q: a quantized file's rows, int8 q [V, d] with
                           // embed_d (and embed_m) [V, d / embed_block] float32, a value d q (+ m)
    int embed_panels;      // 1: the embedding is a tied head's own panels (one copy of the matrix, not two): `embed`,
                           // or with W_Q the head's blocks (`q_row`)
    const float *embed_d, *embed_m;
    int embed_block;
    float embed_scale;     // the embedding rows times this (Gemma's sqrt(d)), or 1
    float qscale;          // the attention scores' scale
    int geglu;             // 1: the MLP's gate through gelu (tanh approximation), else silu
    int64_t rope_local;    // floats from a row of cos, sin to the local layers' same row (0: the same tables)
    // The layers whose outputs a pass also copies out (an EAGLE head's features), row t's j-th into
    // tap_out [T, n_taps, d]: set by the caller for the pass at hand (n_taps 0: none).
    const int *taps;
    int n_taps;
    float *tap_out;
};

// x [T, d] += (rms(y) * g) row by row: a sub-layer's output normed before the residual add (Gemma's).
static void add_normed(float *x, float *y, int T, int d, float eps, const float *g) {
    rms_rows(y, T, d, eps, g, y);
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++)
        for (int i = 0; i < d; i++) x[(size_t)t * d + i] += y[(size_t)t * d + i];
}

// Where a pass's new K/V go, and which keys each of its rows sees.
//   Strided: one sequence. The past [L, 2, Hkv, S, D] is a strided view of the slab (element
//   strides st[0..3], D's is 1); the new K/V go to out_new [L, 2, Hkv, T, D] (strides ns[0..3]),
//   right after that past; row t sees the past and the new rows 0 .. t.
//   Paged: a flat batch (`kv.step.BatchStep`). The slab [L, 2, Hkv, slots, D] (strides
//   st[0..3]); row t's K/V go to slot slots[t]; it sees the count[t] slots from vis + start[t],
//   in order (its sequence's positions up to its own, or a tree node's prefix and ancestors).
struct Strided {
    const kv_t *past;
    const int64_t *st;
    int S;
    kv_t *out_new;
    const int64_t *ns;
    int keys(int T) const { return S + T; }  // the most keys a row sees
    int64_t turn(int t) const { return t; }    // row t's rotation: row t of cos, sin (they start at position S)
    kv_t *dst(int l, int kv, int g, int t) const { return out_new + l * ns[0] + kv * ns[1] + g * ns[2] + t * ns[3]; }
    static constexpr int rows = ROWS_AT_ONCE;  // rows of one head attended in one call
    void attend(int l, int g, int t0, int nq, const float *q, long ldq, int D, float *scores, long lds, float *out,
                long ldo, int window) const {
        const kv_t *pk = past + (size_t)l * st[0] + g * st[2], *nk = out_new + l * ns[0] + g * ns[2];
        attend_seq(q, ldq, pk, pk + st[1], st[3], nk, nk + ns[1], ns[3], S, t0, nq, D, scores, lds, out, ldo, window);
    }
};

struct Paged {
    kv_t *slab;
    const int64_t *st, *slots, *vis, *start, *count, *positions;
    int max_keys;
    int keys(int) const { return max_keys; }
    int64_t turn(int t) const { return positions[t]; }  // row t's rotation: cos, sin's row of its position
    kv_t *dst(int l, int kv, int g, int t) const { return slab + l * st[0] + kv * st[1] + g * st[2] + slots[t] * st[3]; }
    static constexpr int rows = 1;  // each row its own keys
    void attend(int l, int g, int t, int, const float *q, long, int D, float *scores, long, float *out, long,
                int window) const {
        // a local layer's row: the last `window` of its keys (a tree node's are its prefix, then its ancestors)
        const int n = (int)count[t], lo = window && n > window ? n - window : 0;
        const kv_t *k = slab + (size_t)l * st[0] + g * st[2], *v = k + st[1];
        const int64_t *seen = vis + start[t] + lo, ps = st[3];
        auto key = [=](int j) { return k + seen[j] * ps; };
        auto val = [=](int j) { return v + seen[j] * ps; };
        attend_keys(q, key, val, n - lo, D, scores, out);
    }
};

// One decode pass over T new tokens, their K/V addressed by `kv` (above).
// Scratch: sized by the caller (`NativeSteps._need`).
//   xn [T, d], y [T, (H+2Hkv) D], att [T, H D], gu [T, 2F], hf [T, F], scores [threads, ROWS_AT_ONCE, kv.keys(T) + 8]
//
// cos, sin [rows, P] with P = D / 2: each adjacent column pair p of a q or k head turns by column p of
// row kv.turn(t) (a batch's rows read theirs by position: no gathered copy a pass); v does not turn.
// tokens [T]; h [T, d] (the MTP module's input, else null); x [T, d] output: the hidden states
// (every row; the caller keeps the last one for `last`); logits [T_head, V] of the rows
// head_rows[0 .. T_head) (null: the last T_head rows) when the model has a head and T_head > 0;
// top [T_head + 1] (or null): each logits row's argmax, then 1 if every logit is finite, else 0
// (what a greedy verification reads, without a pass of its own over the logits).
template <class KV>
static void pass(const ModelW *mw, const int64_t *tokens, const float *h, int T, const float *cos_t,
                 const float *sin_t, const KV &kv, float *x, float *logits, int T_head, const int64_t *head_rows,
                 float *scratch, int threads, int64_t *top) {
    int finite = 1;
    const int d = mw->dim, H = mw->n_heads, Hkv = mw->n_kv_heads, D = mw->head_dim, F = mw->hidden;
    const int G = H / Hkv, Q = (H + 2 * Hkv) * D, P = D / 2, lds = kv.keys(T) + 8, nb = (T + KV::rows - 1) / KV::rows;
    float *xn = scratch, *y = xn + (size_t)T * d, *att = y + (size_t)T * Q, *gu = att + (size_t)T * H * D;
    float *hf = gu + (size_t)T * 2 * F, *scores = hf + (size_t)T * F;
    const float qscale = mw->qscale;

#pragma omp parallel num_threads(threads)
    {
        // embedding: a Transformer's token rows, or the MTP module's prologue
        if (mw->table) {
            rms_rows(h, T, d, mw->eps, mw->g_h, xn);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) memcpy(x + (size_t)t * d, mw->table + (size_t)tokens[t] * d, d * sizeof(float));
            matmul(xn, T, d, mw->wh, d, d, x, d, true);
        } else {
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                const size_t row = (size_t)tokens[t] * d;
                float *xt = x + (size_t)t * d;
                const uint16_t *e = (const uint16_t *)mw->embed + row;
                if (mw->embed_panels && mw->embed_kind == W_Q) {  // a tied head's blocks: row v of them
                    q_row(mw->head.seg, tokens[t], d, xt);
                } else if (mw->embed_panels) {  // row v: column v % PANEL of panel v / PANEL, a value every PANEL
                    const size_t at = (size_t)(tokens[t] / PANEL) * d * PANEL + tokens[t] % PANEL;
                    const uint16_t *h = (const uint16_t *)mw->embed + at;
                    for (int i = 0; i < d; i++)
                        xt[i] = mw->embed_kind == W_F32 ? ((const float *)mw->embed)[at + (size_t)i * PANEL]
                                : mw->embed_kind == W_BF16 ? bf16_float(h[(size_t)i * PANEL])
                                                           : _cvtsh_ss(h[(size_t)i * PANEL]);
                } else if (mw->embed_kind == W_Q) {  // d q, then + m: two roundings, as `Blocked.values`
                    const int nb = d / mw->embed_block;
                    const int8_t *q = (const int8_t *)mw->embed + row;
                    const float *ds = mw->embed_d + (size_t)tokens[t] * nb;
                    const float *ms = mw->embed_m ? mw->embed_m + (size_t)tokens[t] * nb : nullptr;
                    for (int i = 0; i < d; i += 8) {
                        const int b = i / mw->embed_block;
                        const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))));
                        __m256 v = _mm256_mul_ps(_mm256_set1_ps(ds[b]), qf);
                        if (ms) v = _mm256_add_ps(v, _mm256_set1_ps(ms[b]));
                        _mm256_storeu_ps(xt + i, v);
                    }
                } else if (mw->embed_kind == W_F32)
                    memcpy(xt, (const float *)mw->embed + row, d * sizeof(float));
                else
                    for (int i = 0; i < d; i += 8)
                        _mm256_storeu_ps(xt + i, mw->embed_kind == W_BF16 ? load_b(e + i) : load_h(e + i));
                if (mw->embed_scale != 1.0f)
                    for (int i = 0; i < d; i++) xt[i] *= mw->embed_scale;
            }
        }
        for (int l = 0; l < mw->n_layers; l++) {
            const LayerW &L = mw->layers[l];
            rms_rows(x, T, d, mw->eps, L.g1, xn);
            matmul(xn, T, d, L.qkv, Q, d, y, Q, false);
            // biases and q/k norms where the model has them, rotary turn of each adjacent pair of q and k,
            // the attention scale on q,
            // and the new K/V out: [2, Hkv, T, D] of this layer
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                float *r = y + (size_t)t * Q;
                const size_t at = (size_t)kv.turn(t) * P + (L.window ? mw->rope_local : 0);
                const float *c = cos_t + at, *sn = sin_t + at;
                if (L.bias)
                    for (int i = 0; i < Q; i++) r[i] += L.bias[i];
                if (L.gq)
                    for (int hh = 0; hh < H + Hkv; hh++) head_norm(r + hh * D, D, mw->eps, hh < H ? L.gq : L.gk);
                for (int hh = 0; hh < H + Hkv; hh++)  // q's heads and k's: every head turns alike
                    for (int p = 0; p < P; p++) {
                        float *rp = r + hh * D + 2 * p, a = rp[0], b = rp[1];
                        rp[0] = a * c[p] - b * sn[p];
                        rp[1] = a * sn[p] + b * c[p];
                    }
                for (int i = 0; i < H * D; i++) r[i] *= qscale;
                for (int c = 0; c < 2; c++)
                    for (int g = 0; g < Hkv; g++)
                        kv_store(kv.dst(l, c, g, t), r + (H + c * Hkv + g) * D, D);
            }
            // each head's rows in nb groups of at most KV::rows, of sizes as equal as can be
#pragma omp for schedule(static)
            for (int i = 0; i < H * nb; i++) {
                const int hh = i / nb, b = i % nb, t0 = T * b / nb, nq = T * (b + 1) / nb - t0;
                kv.attend(l, hh / G, t0, nq, y + (size_t)t0 * Q + hh * D, Q, D,
                          scores + (size_t)omp_get_thread_num() * ROWS_AT_ONCE * lds, lds,
                          att + (size_t)t0 * H * D + hh * D, H * D, L.window);
            }
            if (L.g3) {  // the attention's output normed, then added
                matmul(att, T, H * D, L.o, d, H * D, xn, d, false);
                add_normed(x, xn, T, d, mw->eps, L.g3);
            } else {
                matmul(att, T, H * D, L.o, d, H * D, x, d, true);
            }
            rms_rows(x, T, d, mw->eps, L.g2, xn);
            matmul(xn, T, d, L.gu, 2 * F, d, gu, 2 * F, false);
#pragma omp for schedule(static)
            for (int t = 0; t < T; t++) {
                const float *a = gu + (size_t)t * 2 * F, *b = a + F;
                float *o = hf + (size_t)t * F;
                for (int i = 0; i < F; i += 8) {
                    __m256 av = _mm256_loadu_ps(a + i), z = av;
                    if (mw->geglu)  // gelu(a) = a sigmoid(2 sqrt(2/pi) (a + 0.044715 a^3)), its tanh form
                        z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),
                                          _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), av), _mm256_mul_ps(av, av), av));
                    __m256 sg = _mm256_div_ps(_mm256_set1_ps(1.0f),
                                              _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
                    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(av, sg), _mm256_loadu_ps(b + i)));
                }
            }
            if (L.g4) {  // the MLP's output normed, then added
                matmul(hf, T, F, L.down, d, F, xn, d, false);
                add_normed(x, xn, T, d, mw->eps, L.g4);
            } else {
                matmul(hf, T, F, L.down, d, F, x, d, true);
            }
            for (int j = 0; j < mw->n_taps; j++)
                if (mw->taps[j] == l) {
#pragma omp for schedule(static)
                    for (int t = 0; t < T; t++)
                        memcpy(mw->tap_out + ((size_t)t * mw->n_taps + j) * d, x + (size_t)t * d, d * sizeof(float));
                }
        }
        if (mw->head.w && T_head > 0) {
            if (head_rows) {  // the rows asked for, gathered (a batch's last rows)
#pragma omp for schedule(static)
                for (int t = 0; t < T_head; t++) memcpy(xn + (size_t)t * d, x + (size_t)head_rows[t] * d, d * sizeof(float));
                rms_rows(xn, T_head, d, mw->eps, mw->g_final, xn);
            } else {
                rms_rows(x + (size_t)(T - T_head) * d, T_head, d, mw->eps, mw->g_final, xn);
            }
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
    if (top && mw->head.w && T_head > 0) top[T_head] = finite;
}

// A pass over one sequence (see `pass`, `Strided`): past [L, 2, Hkv, S, D] with element strides
// past_st[0..3]; out_new [L, 2, Hkv, T, D] with strides new_st[0..3] (null: contiguous): the new
// K/V, in a buffer or in place in the slab, right after the past (the caller reserved those
// positions); logits of the last T_head rows.
extern "C" void smallem_step(const ModelW *mw, const int64_t *tokens, const float *h, int T, const float *cos_t,
                  const float *sin_t, const kv_t *past, const int64_t *past_st, int S, float *x, float *logits,
                  int T_head, kv_t *out_new, const int64_t *new_st, float *scratch, int threads, int64_t *top) {
    const int64_t packed[4] = {(int64_t)2 * mw->n_kv_heads * T * mw->head_dim, (int64_t)mw->n_kv_heads * T * mw->head_dim,
                               (int64_t)T * mw->head_dim, mw->head_dim};
    const Strided kv{past, past_st, S, out_new, new_st ? new_st : packed};
    pass(mw, tokens, h, T, cos_t, sin_t, kv, x, logits, T_head, nullptr, scratch, threads, top);
}

// A pass over a flat batch (see `pass`, `Paged`): row t at position positions[t] (cos, sin: the
// whole tables, [context, P]); the slab [L, 2, Hkv, slots, D] with element strides slab_st[0..3];
// row t's K/V to slots[t], its keys the count[t] slots from vis + start[t] (at most max_keys);
// logits of the rows head_rows[0 .. T_head) (null: the last T_head).
extern "C" void smallem_batch_step(const ModelW *mw, const int64_t *tokens, const float *h, int T,
                                   const int64_t *positions, const float *cos_t, const float *sin_t, kv_t *slab,
                                   const int64_t *slab_st, const int64_t *slots, const int64_t *vis,
                                   const int64_t *start, const int64_t *count, int max_keys, float *x, float *logits,
                                   int T_head, const int64_t *head_rows, float *scratch, int threads, int64_t *top) {
    const Paged kv{slab, slab_st, slots, vis, start, count, positions, max_keys};
    pass(mw, tokens, h, T, cos_t, sin_t, kv, x, logits, T_head, head_rows, scratch, threads, top);
}

// A proposer's chain of k draft tokens in one call (`NativeSteps.chain`). First the catch-up on the
// m >= 1 entries the round confirmed (`feed` [m], the MTP module's target states `feed_h` [m, d] or
// null for a draft; their K/V go to the cache at L, L+1, ..): the head picks draft token 1 from its
// last state; then each further draft token feeds the one before it back through the model at the
// next position: the MTP module reads its own last state with it, a draft its token alone. The
// chained entries' K/V are written into `view` after the catch-up's (the caller reserved them; the
// MTP module drops them after the round, a draft keeps those the target accepts), so that each step
// reads them as past.
struct Chain {
    Mat head;               // N rows of d in panels (the proposer's head, maybe cut to N rows)
    int N;
    const float *g_final;   // [d] the final norm
    const int64_t *ids;     // [N] a cut head's row -> token, or null: row = token
    const int64_t *feed;    // [m]
    const float *feed_h;    // [m, d] or null
    int m, k;
    const float *cos_t, *sin_t;  // [m+k-1, P] from position L on
    kv_t *view;             // the model's cache [layers, 2, Hkv, >= L+m+k-1, D]
    const int64_t *st;      // its strides [4]
    int L;
    // Sampled (u non-null): q_j = softmax(logits_j * inv_t) into q [k, N], or with `ids` into q [k, V]
    // (zeroed by the caller: a cut head's q is zero outside its tokens), and draft token j by the
    // inverse CDF on the caller's uniform u [j] (`verify.sample`: the first token whose running sum of
    // q_j, in float64 and in order, exceeds u_j times the total). Greedy: the head's argmax, tops [k]
    // its probability.
    const double *u;
    float inv_t;
    int64_t *tokens;        // [k] out
    float *tops, *q;        // [k] out; [k, N or V] out (sampled)
    float *scratch;         // smallem_step's for T = m (step_scratch floats), then 3 d + N + m d floats
    int step_scratch, threads;
    // The repetition penalty's context before the round (V bytes; null: none): each draft token is
    // scored as the target's row will be (`smallem_penalize`: seen and the draft tokens before it),
    // in `mark` (V bytes of scratch).
    const uint8_t *seen;
    float penalty;
    uint8_t *mark;
    // The chain stops where the head's top probability for the next draft token (at its temperature)
    // falls under this, before drawing it: tokens from it on are -1 (0: never). That confidence tracks
    // acceptance (EAGLE-2); decided before the draw, it leaves each drawn token's law q.
    float min_top;
};

extern "C" void smallem_chain(const ModelW *mw, const Chain *c) {
    const int d = mw->dim, P = mw->head_dim / 2, N = c->N, k = c->k;
    const int64_t *ids = c->ids, *st = c->st;
    const uint8_t *seen = c->seen;
    uint8_t *mark = c->mark;
    kv_t *view = c->view;
    float *scratch = c->scratch, *state = scratch + c->step_scratch, *next = state + d, *xn = next + d;
    float *logits = xn + d, *xs = logits + N;
    int L = c->L;
    // the catch-up (its K/V into the cache at L ..): its last state is where the draft starts
    smallem_step(mw, c->feed, c->feed_h, c->m, c->cos_t, c->sin_t, view, st, L, xs, nullptr, 0, view + L * st[3], st,
                 scratch, c->threads, nullptr);
    memcpy(state, xs + (size_t)(c->m - 1) * d, d * sizeof(float));
    const float *cos_t = c->cos_t + (size_t)c->m * P, *sin_t = c->sin_t + (size_t)c->m * P;
    L += c->m;
    if (seen) memcpy(mark, seen, mw->vocab);  // the penalty's context: seen, then each draft token
    for (int j = 0; j < k; j++) {
#pragma omp parallel num_threads(c->threads)
        {
            rms_rows(state, 1, d, mw->eps, c->g_final, xn);
            matmul(xn, 1, d, c->head, N, d, logits, N, false);
        }
        if (seen)  // the repetition penalty, as the target's rows get it (`smallem_penalize`)
            for (int i = 0; i < N; i++)
                if (mark[ids ? ids[i] : i]) logits[i] = repeated(logits[i], c->penalty);
        int best = 0;
        for (int i = 1; i < N; i++)
            if (logits[i] > logits[best]) best = i;
        if (c->u) {  // q = softmax(logits / T), then the inverse CDF at u_j
            // q_j over the vocabulary: row i of a cut head is token ids[i]'s column
            float *qj = c->q + (size_t)j * (ids ? mw->vocab : N);
            auto col = [&](int i) { return ids ? ids[i] : (int64_t)i; };
            const float inv = 1.0f / exp_sum(logits, logits, N, c->inv_t, logits[best] * c->inv_t);  // logits -> weights
            double total = 0.0;
            for (int i = 0; i < N; i++) {
                qj[col(i)] = logits[i] * inv;
                total += qj[col(i)];
            }
            if (qj[col(best)] < c->min_top) {  // q's own confidence, known before the draw: the law stays exact
                for (int i = j; i < k; i++) c->tokens[i] = -1;
                break;
            }
            const double v = c->u[j] * total;
            double run = 0.0;
            best = N - 1;  // v rounded up to the total: the last
            for (int i = 0; i < N; i++) {
                run += qj[col(i)];
                if (run > v) {
                    best = i;
                    break;
                }
            }
            c->tops[j] = qj[col(best)];
        } else {
            c->tops[j] = 1.0f / exp_sum(logits, logits, N, 1.0f, logits[best]);
        }
        if (!c->u && c->tops[j] < c->min_top) {
            for (int i = j; i < k; i++) c->tokens[i] = -1;
            break;
        }
        c->tokens[j] = ids ? ids[best] : best;
        if (seen) mark[c->tokens[j]] = 1;
        if (j == k - 1) break;
        int64_t tok = c->tokens[j];
        smallem_step(mw, &tok, mw->table ? state : nullptr, 1, cos_t + (size_t)j * P, sin_t + (size_t)j * P, view, st,
                     L + j, next, nullptr, 0, view + (L + j) * st[3], st, scratch, c->threads, nullptr);  // K/V in place
        memcpy(state, next, d * sizeof(float));
    }
}
