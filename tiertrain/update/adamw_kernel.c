/* The CPU tier's AdamW pass (tiertrain/update/native_adamw.py builds and calls it): torch
 * AdamW's update of one contiguous fp32 range, its gradient scaled by the clip factor, and the
 * new values stored into a bf16 or fp16 compute copy in the same pass over memory.
 *
 * Built with the host's own instruction set (-march=native). The update is bound by memory
 * traffic, 28 bytes per element; the compute copy adds 2. Its stores go around the cache
 * (non-temporal) with AVX-512 or AVX2: a plain store first reads the destination's cache
 * line, 2 bytes more per element; so do the new values written into second buffers (the
 * overlapped step's speculation), 12 bytes more per element. The bf16 rounding is ATen's, in integer arithmetic (the
 * bits torch's .to() gives): AVX512_BF16's VCVTNEPS2BF16 measured no faster on an AMD Zen 4,
 * and it flushes subnormals. The threads are an OpenMP team, each updating one contiguous range.
 * docs/concepts.md#the-cpu-update-in-one-pass has the measurements.
 */
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

enum { OUT_NONE = 0, OUT_BF16 = 1, OUT_FP16 = 2, OUT_FP32 = 3 };
enum { BLOCK = 1024 }; /* elements updated before their copy is stored: 4 KiB per array, in L1 */

/* hyperparameters, in order (host_adamw.hyperparameters): decay, 1 - beta1, beta2, 1 - beta2,
 * 1 / sqrt(bias correction 2), eps, step size, gradient factor */
#define ADAMW_ELEMENT(P_IN, P_OUT, M_IN, M_OUT, V_IN, V_OUT, G, i, h)                 \
    do {                                                                               \
        float g_ = (G)[i] * h[7];                                                      \
        float p_ = (P_IN)[i] * h[0];                                                   \
        float m_ = (M_IN)[i];                                                          \
        m_ = m_ + h[1] * (g_ - m_);                                                    \
        float v_ = (V_IN)[i] * h[2] + h[3] * g_ * g_;                                  \
        float d_ = sqrtf(v_) * h[4] + h[5];                                            \
        (P_OUT)[i] = p_ - h[6] * m_ / d_;                                              \
        (M_OUT)[i] = m_;                                                               \
        (V_OUT)[i] = v_;                                                               \
    } while (0)

static void update_in_place(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                            int64_t n, const float *restrict h) {
    for (int64_t i = 0; i < n; ++i) ADAMW_ELEMENT(p, p, m, m, v, v, g, i, h);
}

static void update_into(const float *restrict p, const float *restrict g, const float *restrict m,
                        const float *restrict v, float *restrict p_out, float *restrict m_out,
                        float *restrict v_out, int64_t n, const float *restrict h) {
    for (int64_t i = 0; i < n; ++i) ADAMW_ELEMENT(p, p_out, m, m_out, v, v_out, g, i, h);
}

static inline uint16_t bf16_bits(float x) { /* c10::BFloat16's round to nearest even */
    uint32_t u;
    memcpy(&u, &x, 4);
    if (x != x) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t fp16_bits(float x) { /* IEEE binary16, round to nearest even */
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);         /* NaN */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);        /* rounds to infinity */
    if (a < 0x38800000u) {                                          /* below 2^-14: subnormal or zero */
        float f;
        memcpy(&f, &a, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(f * 16777216.0f)); /* units of 2^-24 */
    }
    uint32_t r = a - 0x38000000u;                                    /* rebias 127 -> 15 */
    return (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

/* The compute copy of n updated values, stored to out (the ISA's generic path). */
static void store_copy(const float *restrict src, void *restrict out, int64_t n, int kind) {
    if (kind == OUT_FP32)
        memcpy(out, src, (size_t)n * sizeof(float));
    else if (kind == OUT_BF16)
        for (int64_t i = 0; i < n; ++i) ((uint16_t *)out)[i] = bf16_bits(src[i]);
    else
        for (int64_t i = 0; i < n; ++i) ((uint16_t *)out)[i] = fp16_bits(src[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
typedef __m512 vec;
#define V(op) _mm512_##op

/* 32 updated values as their 64-byte copy, streamed to a 64-byte-aligned destination */
static inline void stream_copy(uint16_t *out, const vec *x, int kind) {
    __m256i half[2];
    for (int k = 0; k < 2; ++k)
        if (kind == OUT_BF16) { /* bf16_bits on 16 lanes, as ATen's vectorised cast */
            __m512i u = _mm512_castps_si512(x[k]);
            __m512i t = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(t, _mm512_set1_epi32(0x7fff)), u), 16);
            t = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x[k], x[k], _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), t);
            half[k] = _mm512_cvtepi32_epi16(t);
        } else {
            half[k] = _mm512_cvtps_ph(x[k], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
    _mm512_stream_si512((void *)out, _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1));
}
#elif defined(__AVX2__) && defined(__F16C__)
#define LANES 8
typedef __m256 vec;
#define V(op) _mm256_##op

/* 32 updated values as their 64-byte copy, streamed as two 32-byte halves of one cache line */
static inline void stream_copy(uint16_t *out, const vec *x, int kind) {
    for (int k = 0; k < 4; k += 2) {
        __m256i half;
        if (kind == OUT_BF16) {
            __m256i t[2];
            for (int j = 0; j < 2; ++j) { /* bf16_bits on 8 lanes, in 32-bit lanes */
                __m256i u = _mm256_castps_si256(x[k + j]);
                t[j] = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
                t[j] = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(t[j], _mm256_set1_epi32(0x7fff)), u), 16);
                t[j] = _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc0), t[j],
                                          _mm256_castps_si256(_mm256_cmp_ps(x[k + j], x[k + j], _CMP_ORD_Q)));
            } /* (packus interleaves the 128-bit lanes: the permute puts them back in order) */
            half = _mm256_permute4x64_epi64(_mm256_packus_epi32(t[0], t[1]), 0xd8);
        } else {
            half = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm256_cvtps_ph(x[k], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                _mm256_cvtps_ph(x[k + 1], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), 1);
        }
        _mm256_stream_si256((__m256i *)(out + 16 * (k / 2)), half);
    }
}
#endif

#ifdef LANES
static inline vec update_lanes(const float *p, const float *g, const float *m, const float *v, float *p_out,
                               float *m_out, float *v_out, const vec *h, int stream) {
    /* ADAMW_ELEMENT's operations, in its order, on LANES elements */
    vec g_ = V(mul_ps)(V(loadu_ps)(g), h[7]);
    vec p_ = V(mul_ps)(V(loadu_ps)(p), h[0]);
    vec m_ = V(loadu_ps)(m);
    m_ = V(add_ps)(m_, V(mul_ps)(h[1], V(sub_ps)(g_, m_)));
    vec v_ = V(add_ps)(V(mul_ps)(V(loadu_ps)(v), h[2]), V(mul_ps)(V(mul_ps)(h[3], g_), g_));
    vec d_ = V(add_ps)(V(mul_ps)(V(sqrt_ps)(v_), h[4]), h[5]);
    p_ = V(sub_ps)(p_, V(div_ps)(V(mul_ps)(h[6], m_), d_));
    if (stream) { /* outputs apart from the inputs: not in the cache, and not read again by this pass */
        V(stream_ps)(p_out, p_);
        V(stream_ps)(m_out, m_);
        V(stream_ps)(v_out, v_);
    } else {
        V(storeu_ps)(p_out, p_);
        V(storeu_ps)(m_out, m_);
        V(storeu_ps)(v_out, v_);
    }
    return p_;
}

/* The update of the first elements of a range, 32 per iteration, each one's copy rounded in
 * registers and streamed to a 64-byte-aligned destination; returns how many it did (the rest,
 * fewer than 32 and any copy the vectors cannot store, take the generic path). */
static int64_t update_vectors(float *p, const float *g, float *m, float *v, float *p_out, float *m_out,
                              float *v_out, void *out, int kind, int64_t n, const float *h) {
    int64_t i = 0;
    if (kind == OUT_FP32) return 0;
    if (kind != OUT_NONE)
        for (; i < n && ((uintptr_t)((uint16_t *)out + i) & 63); ++i) {
            ADAMW_ELEMENT(p, p_out, m, m_out, v, v_out, g, i, h);
            store_copy(p_out + i, (uint16_t *)out + i, 1, kind);
        }
    vec hv[8];
    for (int k = 0; k < 8; ++k) hv[k] = V(set1_ps)(h[k]);
    /* Into separate outputs, each 64-byte aligned here (and so at every 32 elements after): streamed,
     * which saves the read of each destination line a plain store makes (12 bytes per element). */
    int stream = p_out != p && !(((uintptr_t)(p_out + i) | (uintptr_t)(m_out + i) | (uintptr_t)(v_out + i)) & 63);
    for (; i + 32 <= n; i += 32) {
        vec x[32 / LANES];
        for (int k = 0; k < 32 / LANES; ++k) {
            int64_t j = i + LANES * k;
            x[k] = update_lanes(p + j, g + j, m + j, v + j, p_out + j, m_out + j, v_out + j, hv, stream);
        }
        if (kind != OUT_NONE) stream_copy((uint16_t *)out + i, x, kind);
    }
    return i;
}
#else
static int64_t update_vectors(float *p, const float *g, float *m, float *v, float *p_out, float *m_out,
                              float *v_out, void *out, int kind, int64_t n, const float *h) {
    (void)p, (void)g, (void)m, (void)v, (void)p_out, (void)m_out, (void)v_out, (void)out, (void)kind, (void)n, (void)h;
    return 0;
}
#endif

/* One range of the pass. p_out, m_out, v_out equal to p, m, v: in place. out: the compute copy
 * (kind OUT_BF16, OUT_FP16 or OUT_FP32), or NULL with OUT_NONE. */
static void update_range(float *p, const float *g, float *m, float *v, float *p_out, float *m_out, float *v_out,
                         void *out, int kind, int64_t n, const float *h) {
    int64_t done = update_vectors(p, g, m, v, p_out, m_out, v_out, out, kind, n, h);
    int in_place = p_out == p && m_out == m && v_out == v;
    for (int64_t s = done; s < n; s += BLOCK) {
        int64_t len = n - s < BLOCK ? n - s : BLOCK;
        if (in_place)
            update_in_place(p + s, g + s, m + s, v + s, len, h);
        else
            update_into(p + s, g + s, m + s, v + s, p_out + s, m_out + s, v_out + s, len, h);
        if (kind != OUT_NONE)
            store_copy(p_out + s, (char *)out + (kind == OUT_FP32 ? 4 : 2) * s, len, kind);
    }
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the caller reads the copy */
#endif
}

/* The pass over n elements, one contiguous range per thread (an OpenMP team: torch's own
 * libgomp, which the process has loaded, so the threads are torch's), each range starting at a
 * multiple of 64 elements so that every range's copy is aligned alike. */
void tiertrain_adamw(float *p, const float *g, float *m, float *v, float *p_out, float *m_out, float *v_out,
                     void *out, int kind, int64_t n, const float *h, int threads) {
    int64_t per = ((n + threads - 1) / threads + 63) / 64 * 64;
    int64_t width = kind == OUT_FP32 ? 4 : 2;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
#endif
    {
#ifdef _OPENMP
        int64_t s = (int64_t)omp_get_thread_num() * per;
#else
        for (int64_t s = 0; s < n; s += per)
#endif
        if (s < n)
            update_range(p + s, g + s, m + s, v + s, p_out + s, m_out + s, v_out + s,
                         out ? (char *)out + width * s : NULL, kind, n - s < per ? n - s : per, h);
    }
}
