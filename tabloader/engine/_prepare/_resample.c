/*
 * tabloader.engine._prepare._resample: crop + antialiased bilinear resize + optional mirror of
 * HxWx3 uint8 images, with exactly the arithmetic of torch's uint8
 * interpolate(mode="bilinear", antialias=True) (itself a port of Pillow-SIMD's resampler).
 *
 * Arithmetic (per axis, in double, as aten's _compute_index_ranges_int16_weights):
 *   scale = in / out; support = scale >= 1 ? scale : 1; invscale = scale >= 1 ? 1/scale : 1
 *   center_i = scale * (i + 0.5)
 *   xmin_i = max((int64)(center_i - support + 0.5), 0)
 *   xsize_i = clamp(min((int64)(center_i + support + 0.5), in) - xmin_i, 0, ceil(support)*2+1)
 *   w_ij = tri((xmin_i + j - center_i + 0.5) * invscale), tri(x) = max(0, 1 - |x|),
 *   divided by their sum (summed in j order); precision p = the first p < 22 with
 *   (int)(0.5 + wmax * 2^(p+1)) >= 2^15 (22 if none); w16 = (int)(0.5 + w * 2^p).
 *   out = clamp((2^(p-1) + sum_j w16_j * in_j) >> p, 0, 255), int32.
 * The horizontal pass runs first into a uint8 intermediate, then the vertical one; an axis
 * whose size does not change is not resampled. Sums are exact integers, so the order in
 * which the SIMD code adds them does not matter: both paths give the same bytes.
 *
 * Every output's window is widened to a fixed K taps per axis (the largest xsize), moved
 * left where it would pass the end; the added taps get weight 0, so the sums do not change.
 *
 * Memory safety: the AVX2 horizontal pass loads 16 bytes at a time from 3-byte pixels, i.e.
 * up to 13 bytes past the crop box's right edge. It never reads the source that way: the
 * box's rows are first copied, 16 at a time, into scratch rows with HSLACK bytes of padding
 * (which also makes a cold source, an arena's decode, stream in at memory speed). The
 * vertical pass never reads past a row's bytes. The last byte of the source's last row may
 * be followed by nothing (an image at the end of a shared arena).
 *
 * Dispatch: one table of kernels per instruction set (portable C; AVX2 on x86), one pointer
 * to the table in use: the best one the CPU runs (__builtin_cpu_supports), unless the
 * environment variable TABLOADER_RESAMPLE=scalar (or set_isa("scalar")) picks portable C.
 * Define RS_PORTABLE to build the portable C alone, as on other CPUs (a test compiles it so).
 * The GIL is released while pixels are computed. Scratch memory is per thread and kept.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(RS_PORTABLE)
#define RS_X86 1
#include <immintrin.h>
#define RS_AVX2 __attribute__((target("avx2")))
#endif

/* padding after each copied source row: the AVX2 loads read up to 13 bytes past its end */
#define HSLACK 16

/* ------------------------------------------------------------------ scratch memory */
typedef struct {
    size_t cap;
    unsigned char *p;
} Scratch;

static pthread_key_t g_scratch_key;

static void scratch_release(void *ptr)
{
    Scratch *s = (Scratch *)ptr;
    free(s->p);
    free(s);
}

/* A per-thread buffer of at least n bytes (64-byte aligned), kept for the next call: a fresh
   allocation of this size would be mmap'ed and page-faulted in on every image. NULL when out
   of memory. Called without the GIL. */
static unsigned char *scratch(size_t n)
{
    Scratch *s = (Scratch *)pthread_getspecific(g_scratch_key);
    if (s == NULL) {
        s = (Scratch *)calloc(1, sizeof *s);
        if (s == NULL)
            return NULL;
        if (pthread_setspecific(g_scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    if (s->cap < n) {
        size_t cap = (n + 4095) & ~(size_t)4095;
        void *p = NULL;
        if (posix_memalign(&p, 64, cap) != 0)
            return NULL;
        free(s->p);
        s->p = (unsigned char *)p;
        s->cap = cap;
    }
    return s->p;
}

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* ------------------------------------------------------------------ coefficients */
typedef struct {
    int n;          /* outputs */
    int K;          /* taps per output (fixed) */
    int Kp;         /* K rounded up to even: the SIMD loops take taps in pairs */
    int prec;       /* weight precision, bits */
    int32_t *start; /* first input index of each output's window, start + K <= in */
    int16_t *w;     /* n x Kp weights, zero past each window's own taps */
} Axis;

static int axis_maxk(int64_t in, int64_t out)
{
    double scale = (double)in / (double)out;
    double support = scale >= 1.0 ? scale : 1.0;
    return (int)ceil(support) * 2 + 1;
}

/* upper bound of Kp for the scratch layout */
static int axis_kp_bound(int64_t in, int64_t out)
{
    int k = axis_maxk(in, out);
    if (k > in)
        k = (int)in;
    return k + (k & 1);
}

static double tri(double x)
{
    if (x < 0.0)
        x = -x;
    if (x < 1.0)
        return 1.0 - x;
    return 0.0;
}

/* Fill ax (its start/w arrays already pointed at scratch) for in -> out.
   wd: out * maxk doubles, xs: 2 * out int64 (temporaries). */
static void compute_axis(int64_t in, int64_t out, Axis *ax, double *wd, int64_t *xs)
{
    const double scale = (double)in / (double)out;
    const double support = scale >= 1.0 ? (2 * 0.5) * scale : 2 * 0.5;
    const int maxk = (int)ceil(support) * 2 + 1;
    const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    double wmax = 0.0;
    int64_t K = 0;
    for (int64_t i = 0; i < out; i++) {
        const double center = scale * ((double)i + 0.5);
        double *w = wd + i * maxk;
        double total = 0.0;
        int64_t xmin = (int64_t)(center - support + 0.5);
        if (xmin < 0)
            xmin = 0;
        int64_t xmax = (int64_t)(center + support + 0.5);
        if (xmax > in)
            xmax = in;
        int64_t xsize = xmax - xmin;
        if (xsize < 0)
            xsize = 0;
        if (xsize > maxk)
            xsize = maxk;
        for (int64_t j = 0; j < xsize; j++) {
            w[j] = tri(((double)(j + xmin) - center + 0.5) * invscale);
            total += w[j];
        }
        if (total != 0.0) {
            for (int64_t j = 0; j < xsize; j++) {
                w[j] /= total;
                if (wmax < w[j])
                    wmax = w[j];
            }
        }
        xs[2 * i] = xmin;
        xs[2 * i + 1] = xsize;
        if (xsize > K)
            K = xsize;
    }
    unsigned int prec;
    for (prec = 0; prec < 22; prec++) {
        int next = (int)(0.5 + wmax * (1 << (prec + 1)));
        if (next >= (1 << 15))
            break;
    }
    if (K < 1)
        K = 1; /* cannot happen (the center tap always weighs > 0); keeps the loops sane */
    const int Kp = (int)(K + (K & 1));
    ax->n = (int)out;
    ax->K = (int)K;
    ax->Kp = Kp;
    ax->prec = (int)prec;
    memset(ax->w, 0, sizeof(int16_t) * (size_t)out * (size_t)Kp);
    for (int64_t i = 0; i < out; i++) {
        int64_t xmin = xs[2 * i], xsize = xs[2 * i + 1];
        int64_t start = xmin < in - K ? xmin : in - K;
        const double *w = wd + i * maxk;
        int16_t *w16 = ax->w + i * Kp + (xmin - start);
        ax->start[i] = (int32_t)start;
        for (int64_t j = 0; j < xsize; j++) {
            double v = w[j] * (1 << prec);
            w16[j] = (int16_t)(v < 0 ? (int)(-0.5 + v) : (int)(0.5 + v));
        }
    }
}

static inline uint8_t clamp_u8(int32_t v, int prec)
{
    v >>= prec;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* ------------------------------------------------------------------ kernel tables */
/* Each instruction set is one table of kernels (as xxHash dispatches): the portable C one
   and, on x86, the AVX2 one. One pointer names the active table: set at import from the CPU
   and TABLOADER_RESAMPLE, and by set_isa. A resize reads it once; planning a pass picks that
   table's row function for the axis's window size; no loop asks which ISA runs. */

/* The AVX2 horizontal pass's table, in output (dst) order: output pixels in pairs, one per
   128-bit lane. off: the byte offset of each pixel's window in the row; w: per pair and tap
   pair, 32 bytes: (w[k], w[k+1]) x 4 for the lane-0 pixel, then for the lane-1 pixel. Padded
   to whole groups of 8 pixels with zero weights at offset 0. */
typedef struct {
    int ngroups; /* groups of 8 output pixels */
    int npw;     /* tap pairs per output: Kp / 2 */
    int32_t *off;
    int16_t *w;
} HTable;

static size_t htable_bytes(int64_t ow, int kp)
{
    size_t pairs = 4 * (size_t)((ow + 7) / 8);
    return round_up(sizeof(int32_t) * 2 * pairs, 64) + sizeof(int16_t) * 16 * pairs * (kp / 2);
}

typedef struct HPass HPass;

/* Source rows a and b (b may be a again: one row) -> output rows da and db (db is then da).
   The source rows are readable HSLACK bytes past their pixels; the output rows are writable
   for rowcap bytes. */
typedef void (*HRowsFn)(const HPass *h, const uint8_t *sa, const uint8_t *sb, uint8_t *da,
                        uint8_t *db, size_t rowcap);

/* One image's horizontal pass: the axis, the mirror, the table the row function reads (the
   AVX2 one's; portable C reads the axis) and that function, set when the pass is planned. */
struct HPass {
    const Axis *ax;
    int flip;
    HTable t;
    HRowsFn rows;
};

/* nbytes of one output row from the v->Kp rows rows[k] (a pad tap repeats the last row) and
   their weights w; acc: scratch for nbytes int32 sums. */
typedef void (*VRowFn)(const uint8_t *const *rows, const int16_t *w, const Axis *v,
                       uint8_t *dst, int nbytes, int32_t *acc);

typedef struct {
    const char *name;
    int (*runs)(void);                           /* whether this CPU runs its code */
    void (*plan_h)(HPass *h);                    /* h->rows (and h->t) for h->ax, h->flip */
    VRowFn (*plan_v)(const Axis *v, int nbytes); /* the vertical pass's row function */
    void (*flip_row)(const uint8_t *s, uint8_t *d, int64_t w); /* w pixels, mirrored */
} Kernels;

/* fns[i] where the table has one for i, else any: the row functions unrolled for a size */
#define PICK(fns, i, any)                                                                      \
    ((i) >= 0 && (size_t)(i) < sizeof(fns) / sizeof(*(fns)) && (fns)[i] ? (fns)[i] : (any))

/* ------------------------------------------------------------------ portable C */
/* One row, cw pixels (from src) -> ow pixels (dst, reversed when flip). Always inlined with
   a constant K (see HROWS_SCALAR): the tap loop unrolls. */
static inline __attribute__((always_inline)) void
hrow_scalar_k(const uint8_t *src, uint8_t *dst, const Axis *ax, int flip, const int K)
{
    /* locals: the stores to dst (bytes) could alias *ax */
    const int ow = ax->n, Kp = ax->Kp, prec = ax->prec;
    const int32_t *start = ax->start;
    const int16_t *wts = ax->w;
    const int32_t init = 1 << (prec - 1);
    for (int ox = 0; ox < ow; ox++) {
        const int x = flip ? ow - 1 - ox : ox;
        const uint8_t *s = src + 3 * (size_t)start[x];
        const int16_t *w = wts + (size_t)x * Kp;
        int32_t r = init, g = init, b = init;
        for (int k = 0; k < K; k++) {
            r += w[k] * s[3 * k];
            g += w[k] * s[3 * k + 1];
            b += w[k] * s[3 * k + 2];
        }
        dst[3 * ox] = clamp_u8(r, prec);
        dst[3 * ox + 1] = clamp_u8(g, prec);
        dst[3 * ox + 2] = clamp_u8(b, prec);
    }
}

#define HROWS_SCALAR(name, K)                                                                  \
    static void name(const HPass *h, const uint8_t *sa, const uint8_t *sb, uint8_t *da,        \
                     uint8_t *db, size_t rowcap)                                               \
    {                                                                                          \
        (void)rowcap;                                                                          \
        hrow_scalar_k(sa, da, h->ax, h->flip, K);                                              \
        if (sb != sa)                                                                          \
            hrow_scalar_k(sb, db, h->ax, h->flip, K);                                          \
    }
HROWS_SCALAR(hrows_scalar_2, 2)
HROWS_SCALAR(hrows_scalar_3, 3)
HROWS_SCALAR(hrows_scalar_4, 4)
HROWS_SCALAR(hrows_scalar_5, 5)
HROWS_SCALAR(hrows_scalar_6, 6)
HROWS_SCALAR(hrows_scalar_any, h->ax->K)

static void plan_h_scalar(HPass *h)
{
    static const HRowsFn by_k[] = {NULL,           NULL,           hrows_scalar_2, hrows_scalar_3,
                                   hrows_scalar_4, hrows_scalar_5, hrows_scalar_6};
    h->rows = PICK(by_k, h->ax->K, hrows_scalar_any);
}

static void vrow_scalar(const uint8_t *const *rows, const int16_t *w, const Axis *v,
                        uint8_t *dst, int nbytes, int32_t *acc)
{
    const int K = v->K, prec = v->prec; /* locals: acc's stores could alias *v */
    const int32_t init = 1 << (prec - 1);
    for (int x = 0; x < nbytes; x++)
        acc[x] = init;
    for (int k = 0; k < K; k++) {
        const int32_t wk = w[k];
        const uint8_t *row = rows[k];
        for (int x = 0; x < nbytes; x++)
            acc[x] += wk * row[x];
    }
    for (int x = 0; x < nbytes; x++)
        dst[x] = clamp_u8(acc[x], prec);
}

static VRowFn plan_v_scalar(const Axis *v, int nbytes)
{
    (void)v;
    (void)nbytes;
    return vrow_scalar;
}

/* Pixels x.. of a row of w pixels, mirrored. */
static inline void flip_pixels(const uint8_t *s, uint8_t *d, int64_t w, int64_t x)
{
    for (; x < w; x++) {
        const uint8_t *p = s + 3 * (size_t)(w - 1 - x);
        d[3 * x] = p[0];
        d[3 * x + 1] = p[1];
        d[3 * x + 2] = p[2];
    }
}

static void flip_row_scalar(const uint8_t *s, uint8_t *d, int64_t w) { flip_pixels(s, d, w, 0); }

static int runs_everywhere(void) { return 1; }

static const Kernels SCALAR = {
    .name = "scalar",
    .runs = runs_everywhere,
    .plan_h = plan_h_scalar,
    .plan_v = plan_v_scalar,
    .flip_row = flip_row_scalar,
};

/* ------------------------------------------------------------------ AVX2 */
#ifdef RS_X86
static inline int32_t load_i32(const int16_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void build_htable(const Axis *ax, int flip, HTable *t)
{
    const int ow = ax->n, Kp = ax->Kp, npw = Kp / 2;
    t->ngroups = (ow + 7) / 8;
    t->npw = npw;
    const int npix = 8 * t->ngroups;
    int32_t *w32 = (int32_t *)t->w; /* per pair and tap pair: 4 x lane 0's, 4 x lane 1's */
    for (int ox = 0; ox < npix; ox++) {
        int32_t *d = w32 + (size_t)(ox / 2) * npw * 8 + 4 * (ox % 2);
        if (ox >= ow) {
            t->off[ox] = 0;
            for (int tp = 0; tp < npw; tp++, d += 8)
                d[0] = d[1] = d[2] = d[3] = 0;
            continue;
        }
        const int x = flip ? ow - 1 - ox : ox;
        t->off[ox] = 3 * ax->start[x];
        const int16_t *w = ax->w + (size_t)x * Kp;
        for (int tp = 0; tp < npw; tp++, d += 8) {
            int32_t pair;
            memcpy(&pair, w + 2 * tp, 4);
            d[0] = d[1] = d[2] = d[3] = pair;
        }
    }
}

/* One output pair's r, g, b (and an unused 4th) as int32 lanes, already shifted: taps in
   pairs, (value, value) x (weight, weight) 16-bit products summed by pmaddwd. The source row
   must be readable HSLACK bytes past 3 * (start + K): 16 bytes are loaded from each window
   position (5 1/3 pixels for 4 taps). Always inlined with a constant Kp (see hrow_avx2). */
__attribute__((always_inline)) RS_AVX2 static inline __m256i
hpair_avx2(const uint8_t *p0, const uint8_t *p1, const __m256i *w, const int Kp, __m256i init,
           int prec)
{
    const __m256i m01 = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                                         0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i m23 = _mm256_setr_epi8(6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1,
                                         -1, 6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1,
                                         -1, -1);
    __m256i acc = init;
    int k = 0;
    for (; k + 4 <= Kp; k += 4, w += 2) {
        __m256i s = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + 3 * k))),
            _mm_loadu_si128((const __m128i *)(p1 + 3 * k)), 1);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(s, m01),
                                                      _mm256_load_si256(w)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(s, m23),
                                                      _mm256_load_si256(w + 1)));
    }
    if (k < Kp) {
        __m256i s = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p0 + 3 * k))),
            _mm_loadu_si128((const __m128i *)(p1 + 3 * k)), 1);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_shuffle_epi8(s, m01),
                                                      _mm256_load_si256(w)));
    }
    return _mm256_srai_epi32(acc, prec);
}

/* Four pairs (a group of 8 output pixels, the g-th) packed to bytes, reordered across lanes,
   compacted from 4 to 3 bytes per pixel and stored as 2 x 16 bytes at 24 g (the last 4 of
   which the next group overwrites). dst must be writable for rowcap bytes; a group that would
   pass it goes through a buffer. */
__attribute__((always_inline)) RS_AVX2 static inline void
store_group(__m256i a0, __m256i a1, __m256i a2, __m256i a3, uint8_t *dst, size_t rowcap, int g,
            int ow)
{
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i compact = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1,
                                             -1, 0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1,
                                             -1, -1);
    __m256i b = _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
    b = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(b, order), compact);
    const size_t at = 24 * (size_t)g;
    if (at + 28 <= rowcap) {
        _mm_storeu_si128((__m128i *)(dst + at), _mm256_castsi256_si128(b));
        _mm_storeu_si128((__m128i *)(dst + at + 12), _mm256_extracti128_si256(b, 1));
    } else {
        uint8_t tmp[32];
        int n = ow - 8 * g < 8 ? ow - 8 * g : 8;
        _mm_storeu_si128((__m128i *)tmp, _mm256_castsi256_si128(b));
        _mm_storeu_si128((__m128i *)(tmp + 12), _mm256_extracti128_si256(b, 1));
        memcpy(dst + at, tmp, 3 * (size_t)n);
    }
}

/* Rows a and b (b may be a again): cw source pixels -> ow output pixels (already in dst
   order in the table), 8 at a time: four pairs packed to bytes, reordered across lanes,
   compacted from 4 to 3 bytes per pixel and stored as 2 x 16 bytes (the last 4 of which the
   next group overwrites). Two rows share the table's reads. dst rows must be writable for
   rowcap bytes; groups that would pass it go through a buffer. */
__attribute__((always_inline)) RS_AVX2 static inline void
hrow_avx2_k(const uint8_t *sa, const uint8_t *sb, uint8_t *da, uint8_t *db, size_t rowcap,
            const HTable *t, int ow, const int Kp, int prec)
{
    const __m256i init = _mm256_set1_epi32(1 << (prec - 1));
    const int32_t *off = t->off;
    const __m256i *w = (const __m256i *)t->w;
    const int step = Kp / 2; /* weight vectors per pair */
    for (int g = 0; g < t->ngroups; g++, off += 8, w += 4 * step) {
        __m256i a0 = hpair_avx2(sa + off[0], sa + off[1], w, Kp, init, prec);
        __m256i b0 = hpair_avx2(sb + off[0], sb + off[1], w, Kp, init, prec);
        __m256i a1 = hpair_avx2(sa + off[2], sa + off[3], w + step, Kp, init, prec);
        __m256i b1 = hpair_avx2(sb + off[2], sb + off[3], w + step, Kp, init, prec);
        __m256i a2 = hpair_avx2(sa + off[4], sa + off[5], w + 2 * step, Kp, init, prec);
        __m256i b2 = hpair_avx2(sb + off[4], sb + off[5], w + 2 * step, Kp, init, prec);
        __m256i a3 = hpair_avx2(sa + off[6], sa + off[7], w + 3 * step, Kp, init, prec);
        __m256i b3 = hpair_avx2(sb + off[6], sb + off[7], w + 3 * step, Kp, init, prec);
        store_group(a0, a1, a2, a3, da, rowcap, g, ow);
        store_group(b0, b1, b2, b3, db, rowcap, g, ow);
    }
}

#define HROWS_AVX2(name, Kp)                                                                   \
    RS_AVX2 static void name(const HPass *h, const uint8_t *sa, const uint8_t *sb, uint8_t *da, \
                             uint8_t *db, size_t rowcap)                                       \
    {                                                                                          \
        hrow_avx2_k(sa, sb, da, db, rowcap, &h->t, h->ax->n, Kp, h->ax->prec);                 \
    }
HROWS_AVX2(hrows_avx2_2, 2)
HROWS_AVX2(hrows_avx2_4, 4)
HROWS_AVX2(hrows_avx2_6, 6)
HROWS_AVX2(hrows_avx2_8, 8)
HROWS_AVX2(hrows_avx2_any, h->ax->Kp)

static void plan_h_avx2(HPass *h)
{
    static const HRowsFn by_kp[] = {NULL, NULL,         hrows_avx2_2, NULL,        hrows_avx2_4,
                                    NULL, hrows_avx2_6, NULL,         hrows_avx2_8};
    build_htable(h->ax, h->flip, &h->t);
    h->rows = PICK(by_kp, h->ax->Kp, hrows_avx2_any);
}

/* 32 bytes of an output row: rows in pairs, bytes interleaved (a0 b0 a1 b1 ...) and widened
   to 16 bits, times (wa, wb) by pmaddwd; all shuffles stay within 128-bit lanes, so the
   packs put the bytes back in order. rows has Kp entries (the pad tap repeats a row).
   Always inlined with a constant Kp (see vrow_avx2). */
__attribute__((always_inline)) RS_AVX2 static inline __m256i
vchunk_avx2(const uint8_t *const *rows, const __m256i *wk, const int Kp, __m256i init,
            __m128i shift, size_t x)
{
    const __m256i zero = _mm256_setzero_si256();
    __m256i acc0 = init, acc1 = init, acc2 = init, acc3 = init;
    for (int k = 0; k < Kp; k += 2) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(rows[k] + x));
        __m256i b = _mm256_loadu_si256((const __m256i *)(rows[k + 1] + x));
        __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
        acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), wk[k / 2]));
        acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), wk[k / 2]));
        acc2 = _mm256_add_epi32(acc2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), wk[k / 2]));
        acc3 = _mm256_add_epi32(acc3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), wk[k / 2]));
    }
    acc0 = _mm256_sra_epi32(acc0, shift);
    acc1 = _mm256_sra_epi32(acc1, shift);
    acc2 = _mm256_sra_epi32(acc2, shift);
    acc3 = _mm256_sra_epi32(acc3, shift);
    return _mm256_packus_epi16(_mm256_packs_epi32(acc0, acc1), _mm256_packs_epi32(acc2, acc3));
}

/* nbytes (>= 32) of an output row, 32 at a time; the last 32 again, overlapping (the same
   values), when nbytes is not a multiple of 32. */
__attribute__((always_inline)) RS_AVX2 static inline void
vrow_avx2_k(const uint8_t *const *rows_in, const int16_t *w, const int Kp, int prec,
            uint8_t *dst, int nbytes)
{
    const uint8_t *rows[64];
    __m256i wk[32];
    for (int k = 0; k < Kp; k++)
        rows[k] = rows_in[k];
    for (int k = 0; k < Kp; k += 2)
        wk[k / 2] = _mm256_set1_epi32(load_i32(w + k));
    const __m256i init = _mm256_set1_epi32(1 << (prec - 1));
    const __m128i shift = _mm_cvtsi32_si128(prec);
    size_t x = 0;
    for (; x + 32 <= (size_t)nbytes; x += 32)
        _mm256_storeu_si256((__m256i *)(dst + x), vchunk_avx2(rows, wk, Kp, init, shift, x));
    if (x < (size_t)nbytes) {
        x = (size_t)nbytes - 32;
        _mm256_storeu_si256((__m256i *)(dst + x), vchunk_avx2(rows, wk, Kp, init, shift, x));
    }
}

#define VROW_AVX2(name, Kp)                                                                    \
    RS_AVX2 static void name(const uint8_t *const *rows, const int16_t *w, const Axis *v,      \
                             uint8_t *dst, int nbytes, int32_t *acc)                           \
    {                                                                                          \
        (void)acc;                                                                             \
        vrow_avx2_k(rows, w, Kp, v->prec, dst, nbytes);                                        \
    }
VROW_AVX2(vrow_avx2_2, 2)
VROW_AVX2(vrow_avx2_4, 4)
VROW_AVX2(vrow_avx2_6, 6)
VROW_AVX2(vrow_avx2_8, 8)
VROW_AVX2(vrow_avx2_any, v->Kp)

/* A row shorter than one vector (32 bytes), or a window of more than 64 taps (a shrink by more
   than 31x: vrow_avx2_k's tables hold 64), is summed by the portable code (the same bytes). */
static VRowFn plan_v_avx2(const Axis *v, int nbytes)
{
    static const VRowFn by_kp[] = {NULL, NULL,         vrow_avx2_2, NULL,        vrow_avx2_4,
                                   NULL, vrow_avx2_6, NULL,         vrow_avx2_8};
    if (nbytes < 32 || v->Kp > 64)
        return vrow_scalar;
    return PICK(by_kp, v->Kp, vrow_avx2_any);
}

/* A row of w pixels mirrored, 5 pixels (15 bytes) per shuffle: the 16 bytes loaded end at the
   5 pixels' end (starting one byte before them), the 16th byte stored is the next pixel's
   first, written again next. */
RS_AVX2 static void flip_row_avx2(const uint8_t *s, uint8_t *d, int64_t w)
{
    const __m128i rev = _mm_setr_epi8(13, 14, 15, 10, 11, 12, 7, 8, 9, 4, 5, 6, 1, 2, 3, 0);
    int64_t ox = 0;
    for (; ox + 6 <= w; ox += 5) {
        __m128i v = _mm_loadu_si128((const __m128i *)(s + 3 * (w - 5 - ox) - 1));
        _mm_storeu_si128((__m128i *)(d + 3 * ox), _mm_shuffle_epi8(v, rev));
    }
    flip_pixels(s, d, w, ox);
}

static int runs_avx2(void) { return __builtin_cpu_supports("avx2") != 0; }

static const Kernels AVX2 = {
    .name = "avx2",
    .runs = runs_avx2,
    .plan_h = plan_h_avx2,
    .plan_v = plan_v_avx2,
    .flip_row = flip_row_avx2,
};
#endif

/* Every table, best first. */
static const Kernels *const TABLES[] = {
#ifdef RS_X86
    &AVX2,
#endif
    &SCALAR,
};
#define NTABLES (sizeof TABLES / sizeof *TABLES)

/* The table resizes use from now on: set at import and by set_isa, read once per resize. */
static const Kernels *g_kernels = &SCALAR;

/* ------------------------------------------------------------------ one image */
typedef struct {
    const uint8_t *src;     /* pixel (0, 0) of the source */
    Py_ssize_t sstride;     /* source row stride, bytes (> 0) */
    int64_t top, left, ch, cw;
    uint8_t *dst;           /* pixel (0, 0) of the output */
    Py_ssize_t dstride;     /* output row stride, bytes */
    int64_t oh, ow;
    int flip;
} Job;

static void copy_row(const uint8_t *s, uint8_t *d, int64_t w, int flip, const Kernels *kn)
{
    if (flip)
        kn->flip_row(s, d, w);
    else
        memcpy(d, s, 3 * (size_t)w);
}

#define CHUNK 16 /* source rows copied at a time */

/* Scratch bytes one job needs (an upper bound). */
static size_t job_scratch(const Job *j)
{
    size_t n = 0;
    int64_t m = j->oh > j->ow ? j->oh : j->ow;
    int mk = axis_maxk(j->cw, j->ow) > axis_maxk(j->ch, j->oh) ? axis_maxk(j->cw, j->ow)
                                                                : axis_maxk(j->ch, j->oh);
    n += round_up(sizeof(double) * (size_t)m * (size_t)mk, 64);             /* float weights */
    n += round_up(sizeof(int64_t) * 2 * (size_t)m, 64);                     /* xmin, xsize */
    n += round_up(sizeof(int32_t) * (size_t)j->ow, 64);                     /* h starts */
    n += round_up(sizeof(int16_t) * (size_t)j->ow * axis_kp_bound(j->cw, j->ow), 64);
    n += round_up(sizeof(int32_t) * (size_t)j->oh, 64);                     /* v starts */
    n += round_up(sizeof(int16_t) * (size_t)j->oh * axis_kp_bound(j->ch, j->oh), 64);
    n += round_up(sizeof(int32_t) * 3 * (size_t)j->ow, 64);                 /* scalar sums */
    n += round_up(3 * (size_t)j->ow + 64, 64);                              /* a flipped row */
    n += round_up(sizeof(uint8_t *) * (size_t)(axis_kp_bound(j->ch, j->oh) + 1), 64);
    n += round_up(htable_bytes(j->ow, axis_kp_bound(j->cw, j->ow)), 64);    /* AVX2 table */
    n += CHUNK * round_up(3 * (size_t)j->cw + HSLACK, 64);                  /* source rows */
    n += (size_t)j->ch * round_up(3 * (size_t)j->ow + 32, 64);              /* intermediate */
    return n + 64;
}

static unsigned char *carve(unsigned char **p, size_t n)
{
    unsigned char *r = *p;
    *p += round_up(n, 64);
    return r;
}

/* The horizontal pass over the box's rows r0..r1 (all of them without a vertical pass):
   copied CHUNK at a time into scratch rows (chunk, cstride apart), then resampled two at a
   time into out (ostride apart, rowcap bytes each). A cold source (an arena's decode) streams
   in at memory speed when its rows are read back to back, and a row read while the previous
   one is being computed arrives late. */
static void hpass(const Job *j, const HPass *h, int64_t r0, int64_t r1, uint8_t *chunk,
                  size_t cstride, uint8_t *out, size_t ostride, size_t rowcap)
{
    for (int64_t c0 = r0; c0 < r1; c0 += CHUNK) {
        const int64_t c1 = c0 + CHUNK < r1 ? c0 + CHUNK : r1;
        for (int64_t r = c0; r < c1; r++) {
            memcpy(chunk + (r - c0) * cstride, j->src + (j->top + r) * j->sstride + 3 * j->left,
                   3 * (size_t)j->cw);
            memset(chunk + (r - c0) * cstride + 3 * (size_t)j->cw, 0, HSLACK);
        }
        for (int64_t r = c0; r < c1; r += 2) {
            const int two = r + 1 < c1;
            const uint8_t *row = chunk + (r - c0) * cstride;
            uint8_t *d = out + (r - r0) * ostride;
            h->rows(h, row, two ? row + cstride : row, d, two ? d + ostride : d, rowcap);
        }
    }
}

/* Resize one job with the kernels kn. Without the GIL. Returns -1 when out of memory. */
static int run_job(const Job *j, const Kernels *kn)
{
    const int needh = j->cw != j->ow, needv = j->ch != j->oh;
    if (!needh && !needv) {
        for (int64_t y = 0; y < j->oh; y++)
            copy_row(j->src + (j->top + y) * j->sstride + 3 * j->left, j->dst + y * j->dstride,
                     j->ow, j->flip, kn);
        return 0;
    }
    unsigned char *mem = scratch(job_scratch(j));
    if (mem == NULL)
        return -1;
    unsigned char *p = mem;
    int64_t m = j->oh > j->ow ? j->oh : j->ow;
    int mk = axis_maxk(j->cw, j->ow) > axis_maxk(j->ch, j->oh) ? axis_maxk(j->cw, j->ow)
                                                               : axis_maxk(j->ch, j->oh);
    double *wd = (double *)carve(&p, sizeof(double) * (size_t)m * (size_t)mk);
    int64_t *xs = (int64_t *)carve(&p, sizeof(int64_t) * 2 * (size_t)m);
    Axis H, V;
    H.start = (int32_t *)carve(&p, sizeof(int32_t) * (size_t)j->ow);
    H.w = (int16_t *)carve(&p, sizeof(int16_t) * (size_t)j->ow * axis_kp_bound(j->cw, j->ow));
    V.start = (int32_t *)carve(&p, sizeof(int32_t) * (size_t)j->oh);
    V.w = (int16_t *)carve(&p, sizeof(int16_t) * (size_t)j->oh * axis_kp_bound(j->ch, j->oh));
    int32_t *acc = (int32_t *)carve(&p, sizeof(int32_t) * 3 * (size_t)j->ow);
    uint8_t *fliprow = carve(&p, 3 * (size_t)j->ow + 64);
    const uint8_t **rows =
        (const uint8_t **)carve(&p, sizeof(uint8_t *) * (size_t)(axis_kp_bound(j->ch, j->oh) + 1));
    HPass hp = {.ax = &H, .flip = j->flip};
    size_t tb = htable_bytes(j->ow, axis_kp_bound(j->cw, j->ow));
    hp.t.off = (int32_t *)p;
    hp.t.w = (int16_t *)(p + round_up(sizeof(int32_t) * 8 * (size_t)((j->ow + 7) / 8), 64));
    carve(&p, tb);
    const size_t cstride = round_up(3 * (size_t)j->cw + HSLACK, 64);
    uint8_t *chunk = carve(&p, CHUNK * cstride);
    uint8_t *inter = p;
    const size_t istride = round_up(3 * (size_t)j->ow + 32, 64);

    if (needh)
        compute_axis(j->cw, j->ow, &H, wd, xs);
    if (needv)
        compute_axis(j->ch, j->oh, &V, wd, xs);

    if (needh) {
        kn->plan_h(&hp);
        if (!needv) {
            hpass(j, &hp, 0, j->ch, chunk, cstride, j->dst, (size_t)j->dstride,
                  3 * (size_t)j->ow);
            return 0;
        }
        /* only the rows of the box the vertical pass reads */
        hpass(j, &hp, V.start[0], V.start[j->oh - 1] + V.K, chunk, cstride, inter, istride,
              istride);
    }
    /* vertical: from the intermediate, or straight from the box */
    const VRowFn vrow = kn->plan_v(&V, (int)(3 * j->ow));
    const int64_t r0 = needh ? V.start[0] : 0;
    const uint8_t *base = needh ? inter : j->src + j->top * j->sstride + 3 * j->left;
    const Py_ssize_t bstride = needh ? (Py_ssize_t)istride : j->sstride;
    const int nbytes = (int)(3 * j->ow);
    const int flip_after = !needh && j->flip;
    for (int64_t y = 0; y < j->oh; y++) {
        for (int k = 0; k < V.K; k++)
            rows[k] = base + (V.start[y] + k - r0) * bstride;
        for (int k = V.K; k < V.Kp; k++)
            rows[k] = rows[V.K - 1];
        uint8_t *d = flip_after ? fliprow : j->dst + y * j->dstride;
        vrow(rows, V.w + (size_t)y * V.Kp, &V, d, nbytes, acc);
        if (flip_after)
            kn->flip_row(fliprow, j->dst + y * j->dstride, j->ow);
    }
    return 0;
}


/* ------------------------------------------------------------------ Python glue */
static int is_u8_format(const char *f)
{
    if (f == NULL)
        return 1;
    if (*f && strchr("@=<>!|", *f))
        f++;
    return strcmp(f, "B") == 0;
}

static int is_i64_format(const Py_buffer *b)
{
    const char *f = b->format;
    if (b->itemsize != 8 || f == NULL)
        return 0;
    if (*f && strchr("@=<>!|", *f))
        f++;
    return strcmp(f, "l") == 0 || strcmp(f, "q") == 0;
}

static PyObject *shape_text(const Py_buffer *b)
{
    PyObject *parts = PyList_New(0), *r = NULL;
    if (parts == NULL)
        return NULL;
    for (int i = 0; i < b->ndim; i++) {
        PyObject *n = PyLong_FromSsize_t(b->shape ? b->shape[i] : b->len);
        if (n == NULL || PyList_Append(parts, n) < 0) {
            Py_XDECREF(n);
            goto done;
        }
        Py_DECREF(n);
    }
    {
        PyObject *t = PyList_AsTuple(parts);
        if (t != NULL) {
            r = PyObject_Repr(t);
            Py_DECREF(t);
        }
    }
done:
    Py_DECREF(parts);
    return r;
}

/* An image buffer: uint8, (h, w, 3) (or (n, h, w, 3) for a batch output), pixels as 3
   contiguous bytes, positive row strides. Sets ValueError and returns -1 otherwise. */
static int get_image(PyObject *obj, Py_buffer *b, const char *what, int ndim, int writable)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) ||
            PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be a uint8 array; got %.100s", what,
                         Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    if (writable && b->readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be a writable uint8 array; got a read-only %.100s",
                     what, Py_TYPE(obj)->tp_name);
        goto fail;
    }
    const char *want = ndim == 3 ? "(height, width, 3)" : "(n, height, width, 3)";
    if (!is_u8_format(b->format) || b->itemsize != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be a uint8 array %s; got format '%s'", what,
                     want, b->format ? b->format : "?");
        goto fail;
    }
    if (b->ndim != ndim || b->shape[ndim - 1] != 3) {
        PyObject *s = shape_text(b);
        if (s != NULL) {
            PyErr_Format(PyExc_ValueError, "%s must have shape %s; got %U", what, want, s);
            Py_DECREF(s);
        }
        goto fail;
    }
    for (int i = ndim - 3; i < ndim - 1; i++) { /* a batch may hold no image */
        if (b->shape[i] < 1) {
            PyObject *s = shape_text(b);
            if (s != NULL) {
                PyErr_Format(PyExc_ValueError, "%s is empty: shape %U", what, s);
                Py_DECREF(s);
            }
            goto fail;
        }
    }
    if (b->strides[ndim - 1] != 1 || b->strides[ndim - 2] != 3 || b->strides[ndim - 3] <= 0 ||
        b->strides[ndim - 3] < 3 * b->shape[ndim - 2] ||
        (ndim == 4 && b->strides[0] < b->strides[1] * b->shape[1])) {
        PyErr_Format(PyExc_ValueError,
                     "%s must hold pixels as 3 contiguous bytes in rows of increasing address "
                     "(strides (row, 3, 1), row >= 3 * width); got strides (%zd, %zd, %zd%s); "
                     "pass np.ascontiguousarray(...)",
                     what, b->strides[ndim - 3], b->strides[ndim - 2], b->strides[ndim - 1],
                     ndim == 4 ? ", ..." : "");
        goto fail;
    }
    return 0;
fail:
    PyBuffer_Release(b);
    return -1;
}

static int check_box(int64_t top, int64_t left, int64_t h, int64_t w, int64_t H, int64_t W,
                     const char *where)
{
    if (h < 1 || w < 1 || top < 0 || left < 0 || top > H - h || left > W - w) {
        PyErr_Format(PyExc_ValueError,
                     "%sbox (top, left, height, width) = (%lld, %lld, %lld, %lld) is not a "
                     "non-empty box inside the %lld x %lld source",
                     where, (long long)top, (long long)left, (long long)h, (long long)w,
                     (long long)H, (long long)W);
        return -1;
    }
    return 0;
}

static int too_big(int64_t v) { return v > (1 << 24); }

/* 0, or -1 and a ValueError when a side is over 2**24 pixels. */
static int check_sides(int64_t a, int64_t b, int64_t c)
{
    if (!too_big(a) && !too_big(b) && !too_big(c))
        return 0;
    PyErr_SetString(PyExc_ValueError, "images wider or taller than 2**24 are not supported");
    return -1;
}

/* 0, or -1 and a TypeError naming call (the function's signature) when nargs is not want. */
static int check_nargs(const char *call, Py_ssize_t want, Py_ssize_t nargs)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", call, want, nargs);
    return -1;
}

PyDoc_STRVAR(resize_doc,
             "resize(src, out, top, left, height, width, flip, /)\n--\n\n"
             "Resize the box (top, left, height, width) of src into out, mirrored when flip.\n"
             "\n"
             "The GIL is released while the pixels are computed.\n"
             "\n"
             "Args:\n"
             "    src: uint8 (H, W, 3): pixels as 3 contiguous bytes, rows of any positive "
             "stride.\n"
             "    out: uint8 (h, w, 3), writable, laid out as src may be.\n"
             "    top: The box's first row.\n"
             "    left: The box's first column.\n"
             "    height: The box's rows.\n"
             "    width: The box's columns.\n"
             "    flip: Write the output's columns in reverse order (a left-right mirror).\n"
             "\n"
             "Raises:\n"
             "    ValueError: A wrong dtype, shape or layout, a read-only out, a box that is "
             "empty or\n"
             "        not inside src, or an image over 2**24 pixels wide or tall.");

static PyObject *py_resize(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    (void)mod;
    if (check_nargs("resize(src, out, top, left, height, width, flip)", 7, nargs) < 0)
        return NULL;
    int64_t box[4];
    for (int i = 0; i < 4; i++) {
        box[i] = PyLong_AsLongLong(args[2 + i]);
        if (box[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    int flip = PyObject_IsTrue(args[6]);
    if (flip < 0)
        return NULL;
    Py_buffer sb, ob;
    if (get_image(args[0], &sb, "src", 3, 0) < 0)
        return NULL;
    if (get_image(args[1], &ob, "out", 3, 1) < 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    Job j;
    int rc = 0;
    if (check_box(box[0], box[1], box[2], box[3], sb.shape[0], sb.shape[1], "") < 0)
        goto done;
    if (check_sides(ob.shape[0], ob.shape[1], sb.shape[1]) < 0)
        goto done;
    j.src = (const uint8_t *)sb.buf;
    j.sstride = sb.strides[0];
    j.top = box[0];
    j.left = box[1];
    j.ch = box[2];
    j.cw = box[3];
    j.dst = (uint8_t *)ob.buf;
    j.dstride = ob.strides[0];
    j.oh = ob.shape[0];
    j.ow = ob.shape[1];
    j.flip = flip;
    {
        const Kernels *kn = g_kernels;
        Py_BEGIN_ALLOW_THREADS
        rc = run_job(&j, kn);
        Py_END_ALLOW_THREADS
    }
    if (rc < 0)
        PyErr_NoMemory();
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ob);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static int get_table(PyObject *obj, Py_buffer *b, const char *what, Py_ssize_t n, int cols)
{
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous int64 array; got %.100s",
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int ok = is_i64_format(b) && b->len == (Py_ssize_t)(8 * n * cols) &&
             (cols == 1 ? b->ndim == 1 : (b->ndim == 2 && b->shape[1] == cols));
    if (!ok) {
        PyObject *s = shape_text(b);
        if (s != NULL) {
            if (cols == 1)
                PyErr_Format(PyExc_ValueError,
                             "%s must be an int64 array of shape (%zd,); got format '%s' shape %U",
                             what, n, b->format ? b->format : "?", s);
            else
                PyErr_Format(PyExc_ValueError,
                             "%s must be an int64 array of shape (%zd, %d); got format '%s' "
                             "shape %U",
                             what, n, cols, b->format ? b->format : "?", s);
            Py_DECREF(s);
        }
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(resize_batch_doc,
             "resize_batch(arena, offsets, shapes, boxes, flips, out, /)\n--\n\n"
             "Resize images held in one buffer, each into its slot of out.\n"
             "\n"
             "Image k, C-contiguous uint8 (h, w, 3) with (h, w) = shapes[k], starts at byte "
             "offsets[k]\n"
             "of arena; its box boxes[k] = (top, left, height, width) is resized into out[k], "
             "mirrored\n"
             "where flips[k]. One call: the GIL is released once for the batch.\n"
             "\n"
             "Args:\n"
             "    arena: A contiguous byte buffer (a shared arena, a uint8 array).\n"
             "    offsets: int64 (n,), C-contiguous.\n"
             "    shapes: int64 (n, 2), C-contiguous.\n"
             "    boxes: int64 (n, 4), C-contiguous.\n"
             "    flips: bool or uint8 (n,), C-contiguous.\n"
             "    out: uint8 (n, h, w, 3), writable: pixels as 3 contiguous bytes.\n"
             "\n"
             "Raises:\n"
             "    ValueError: A table of the wrong dtype or shape, an image outside arena or a "
             "box\n"
             "        outside its image (naming the image), or a wrong out.");

static PyObject *py_resize_batch(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    (void)mod;
    if (check_nargs("resize_batch(arena, offsets, shapes, boxes, flips, out)", 6, nargs) < 0)
        return NULL;
    Py_buffer ab, offb, shb, bxb, flb, ob;
    int have = 0;
    Job *jobs = NULL;
    if (PyObject_GetBuffer(args[0], &ab, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "arena must be a contiguous byte buffer; got %.100s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    have = 1;
    if (get_image(args[5], &ob, "out", 4, 1) < 0)
        goto done;
    have = 2;
    const Py_ssize_t n = ob.shape[0];
    if (get_table(args[1], &offb, "offsets", n, 1) < 0)
        goto done;
    have = 3;
    if (get_table(args[2], &shb, "shapes", n, 2) < 0)
        goto done;
    have = 4;
    if (get_table(args[3], &bxb, "boxes", n, 4) < 0)
        goto done;
    have = 5;
    if (PyObject_GetBuffer(args[4], &flb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "flips must be a bool array of shape (%zd,); got %.100s",
                     n, Py_TYPE(args[4])->tp_name);
        goto done;
    }
    have = 6;
    if (flb.itemsize != 1 || flb.len != n || flb.ndim != 1 || flb.format == NULL ||
        (strcmp(flb.format, "?") != 0 && !is_u8_format(flb.format))) {
        PyObject *s = shape_text(&flb);
        if (s != NULL) {
            PyErr_Format(PyExc_ValueError,
                         "flips must be a bool array of shape (%zd,); got format '%s' shape %U",
                         n, flb.format ? flb.format : "?", s);
            Py_DECREF(s);
        }
        goto done;
    }
    if (check_sides(ob.shape[1], ob.shape[2], 0) < 0)
        goto done;
    jobs = (Job *)PyMem_Malloc(sizeof(Job) * (size_t)(n > 0 ? n : 1));
    if (jobs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const int64_t *off = (const int64_t *)offb.buf, *sh = (const int64_t *)shb.buf,
                      *bx = (const int64_t *)bxb.buf;
        const uint8_t *fl = (const uint8_t *)flb.buf;
        const uint8_t *arena = (const uint8_t *)ab.buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            int64_t h = sh[2 * k], w = sh[2 * k + 1], o = off[k];
            if (h < 1 || w < 1 || too_big(w) || o < 0 || h > (int64_t)ab.len / (3 * w) ||
                o > (int64_t)ab.len - h * w * 3) {
                PyErr_Format(PyExc_ValueError,
                             "image %zd: shape (%lld, %lld) at offset %lld does not fit in the "
                             "%zd-byte arena",
                             k, (long long)h, (long long)w, (long long)o, ab.len);
                goto done;
            }
            char where[64];
            snprintf(where, sizeof where, "image %zd: ", k);
            if (check_box(bx[4 * k], bx[4 * k + 1], bx[4 * k + 2], bx[4 * k + 3], h, w, where) < 0)
                goto done;
            Job *j = &jobs[k];
            j->src = arena + o;
            j->sstride = (Py_ssize_t)(3 * w);
            j->top = bx[4 * k];
            j->left = bx[4 * k + 1];
            j->ch = bx[4 * k + 2];
            j->cw = bx[4 * k + 3];
            j->dst = (uint8_t *)ob.buf + k * ob.strides[0];
            j->dstride = ob.strides[1];
            j->oh = ob.shape[1];
            j->ow = ob.shape[2];
            j->flip = fl[k] != 0;
        }
        int rc = 0;
        const Kernels *kn = g_kernels;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t k = 0; k < n && rc == 0; k++)
            rc = run_job(&jobs[k], kn);
        Py_END_ALLOW_THREADS
        if (rc < 0)
            PyErr_NoMemory();
    }
done:
    PyMem_Free(jobs);
    if (have >= 6)
        PyBuffer_Release(&flb);
    if (have >= 5)
        PyBuffer_Release(&bxb);
    if (have >= 4)
        PyBuffer_Release(&shb);
    if (have >= 3)
        PyBuffer_Release(&offb);
    if (have >= 2)
        PyBuffer_Release(&ob);
    PyBuffer_Release(&ab);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(isa_doc,
             "isa()\n--\n\n"
             "The code path resizes use now: 'avx2' or 'scalar'.");

static PyObject *py_isa(PyObject *mod, PyObject *unused)
{
    (void)mod;
    (void)unused;
    return PyUnicode_FromString(g_kernels->name);
}

/* The best table this CPU runs. */
static const Kernels *best_kernels(void)
{
    for (size_t i = 0; i < NTABLES; i++)
        if (TABLES[i]->runs())
            return TABLES[i];
    return &SCALAR;
}

/* The table named 'scalar' or 'avx2' (one this build or CPU lacks: the best it has), or 'auto'
   or '' (the best); NULL for another name. */
static const Kernels *kernels_named(const char *name)
{
    for (size_t i = 0; i < NTABLES; i++)
        if (strcmp(name, TABLES[i]->name) == 0 && TABLES[i]->runs())
            return TABLES[i];
    if (strcmp(name, "avx2") == 0 || strcmp(name, "auto") == 0 || name[0] == '\0')
        return best_kernels();
    return NULL;
}

PyDoc_STRVAR(set_isa_doc,
             "set_isa(name, /)\n--\n\n"
             "Use a code path for every resize from now on, in every thread.\n"
             "\n"
             "For tests and benchmarks; both paths give the same bytes.\n"
             "\n"
             "Args:\n"
             "    name: 'scalar' (portable C), 'avx2' (where the CPU has it, else the best it "
             "has) or\n"
             "        'auto' (the best the CPU has).\n"
             "\n"
             "Returns:\n"
             "    The path used until now.\n"
             "\n"
             "Raises:\n"
             "    ValueError: An unknown name.");

static PyObject *py_set_isa(PyObject *mod, PyObject *arg)
{
    (void)mod;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL)
        return NULL;
    const Kernels *kn = kernels_named(name);
    if (kn == NULL) {
        PyErr_Format(PyExc_ValueError, "unknown resample path %R; use 'scalar', 'avx2' or 'auto'",
                     arg);
        return NULL;
    }
    const Kernels *old = g_kernels;
    g_kernels = kn;
    return PyUnicode_FromString(old->name);
}

static PyMethodDef methods[] = {
    {"resize", (PyCFunction)(void (*)(void))py_resize, METH_FASTCALL, resize_doc},
    {"resize_batch", (PyCFunction)(void (*)(void))py_resize_batch, METH_FASTCALL,
     resize_batch_doc},
    {"isa", py_isa, METH_NOARGS, isa_doc},
    {"set_isa", py_set_isa, METH_O, set_isa_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_resample",
    .m_doc = "Crop, antialiased bilinear resize and mirror of uint8 (H, W, 3) images, in C.\n"
             "\n"
             "The bytes are those of torch's uint8 ``interpolate(mode=\"bilinear\", "
             "antialias=True)``. Each\n"
             "instruction set is one table of kernels (``ISAS``: those this CPU runs, best "
             "first). Resizes\n"
             "use the best one, unless ``TABLOADER_RESAMPLE=scalar|avx2|auto`` at import or "
             "``set_isa()``\n"
             "picks another; every path gives the same bytes.",
    .m_size = -1,
    .m_methods = methods,
};

/* ISAS: the names of the tables this CPU runs, best first. */
static int add_isas(PyObject *m)
{
    PyObject *names = PyList_New(0), *t = NULL;
    int rc = -1;
    if (names == NULL)
        return -1;
    for (size_t i = 0; i < NTABLES; i++) {
        if (!TABLES[i]->runs())
            continue;
        PyObject *name = PyUnicode_FromString(TABLES[i]->name);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            goto done;
        }
        Py_DECREF(name);
    }
    t = PyList_AsTuple(names);
    if (t != NULL)
        rc = PyModule_AddObjectRef(m, "ISAS", t);
done:
    Py_XDECREF(t);
    Py_DECREF(names);
    return rc;
}

PyMODINIT_FUNC PyInit__resample(void)
{
    static int key_made = 0;
    if (!key_made) {
        if (pthread_key_create(&g_scratch_key, scratch_release) != 0) {
            PyErr_SetString(PyExc_OSError, "pthread_key_create failed");
            return NULL;
        }
        key_made = 1;
    }
#ifdef RS_X86
    __builtin_cpu_init();
#endif
    const char *env = getenv("TABLOADER_RESAMPLE");
    const Kernels *kn = kernels_named(env ? env : "auto");
    g_kernels = kn != NULL ? kn : best_kernels();
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    if (add_isas(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
