/* What the host has for graft's LoRA kernel (cpuid and XCR0), and the kernel's own probe: each function the
 * host has, run once on a small exact case. graft runs the probe in a child process before a server loads
 * the kernel, so an instruction the CPU refuses kills the child. */
#include <cpuid.h>
#include <string.h>

#include "lora_kernel.h"

/* HAS_FP32 | HAS_BF16: what this CPU says it has (cpuid) and its OS saves across switches (XCR0: SSE,
 * AVX, the opmask and both ZMM halves), so a VM that lists AVX-512 without enabling it gets neither. */
int64_t graft_lora_host_features(void) {
    unsigned a, b, c, d, low, high;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) /* OSXSAVE: xgetbv is there */
        return 0;
    const int fma = c >> 12 & 1;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    if ((low & 0xe6) != 0xe6 || __get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const int f = b >> 16 & 1, bw = b >> 30 & 1, vl = b >> 31 & 1;
    int bf16 = 0;
    if (a >= 1) { /* leaf 7's subleaf 1 exists */
        __cpuid_count(7, 1, a, b, c, d);
        bf16 = a >> 5 & 1;
    }
    return (f && fma ? HAS_FP32 : 0) | (f && bw && vl && bf16 ? HAS_BF16 : 0);
}

enum { T_ = 3, S_ = 2, I_ = 40, RANK_ = 2, SLICES_ = 2, R_ = RANK_ * SLICES_, O_ = 24 + 8 };
static const int64_t probe_rows[2] = {2, 0}, probe_slots[2] = {1, 0}, probe_offsets[SLICES_ + 1] = {0, 24, O_};

static int small(int64_t seed) { return (int)(seed % 3) - 1; }
static uint16_t to_bf16(float value) { uint32_t bits; memcpy(&bits, &value, 4); return (uint16_t)(bits >> 16); }
static float from_bf16(uint16_t value) {
    uint32_t bits = (uint32_t)value << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The probe's case: T_ tokens, S_ slots, R_ stacked ranks, O_ outputs in slices of 24 and 8 and I_ inputs
 * (neither a multiple of the fp32 nor the bf16 vector: both tails run); x, A and block-diagonal B of small
 * integers, so that every product and sum is exact in bf16 and fp32 (|y| < 256); want = y + B @ A @ x for
 * rows 2 (slot 1) and 0 (slot 0), row 1 as it was. */
static void probe_case(float x[T_][I_], float a[S_][R_][I_], float b[S_][O_][R_], float y[T_][O_], float want[T_][O_]) {
    for (int t = 0; t < T_; t++)
        for (int i = 0; i < I_; i++) x[t][i] = (float)small(7 * t + 5 * i + 1);
    for (int s = 0; s < S_; s++)
        for (int r = 0; r < R_; r++) {
            for (int i = 0; i < I_; i++) a[s][r][i] = (float)small(3 * s + 11 * r + 2 * i);
            for (int o = 0; o < O_; o++)
                b[s][o][r] = (r / RANK_ == (o >= 24)) ? (float)small(13 * s + r + 17 * o) : 0.f;
        }
    for (int t = 0; t < T_; t++)
        for (int o = 0; o < O_; o++) y[t][o] = want[t][o] = (float)small(t + 3 * o) * 2.f;
    for (int k = 0; k < 2; k++) {
        const int64_t t = probe_rows[k], s = probe_slots[k];
        for (int o = 0; o < O_; o++)
            for (int r = 0; r < R_; r++) {
                float shrunk = 0.f;
                for (int i = 0; i < I_; i++) shrunk += a[s][r][i] * x[t][i];
                want[t][o] += b[s][o][r] * shrunk;
            }
    }
}

static int probe_f32(void) {
    float x[T_][I_], a[S_][R_][I_], b[S_][O_][R_], y[T_][O_], want[T_][O_], b_t[S_][R_][O_];
    probe_case(x, a, b, y, want);
    for (int s = 0; s < S_; s++)
        for (int r = 0; r < R_; r++)
            for (int o = 0; o < O_; o++) b_t[s][r][o] = b[s][o][r];
    if (graft_lora_add_f32(&x[0][0], I_, &y[0][0], O_, &a[0][0][0], &b_t[0][0][0], probe_rows, probe_slots, 2, T_, S_,
                           I_, RANK_, SLICES_, probe_offsets, 1.f) != 2)
        return 0;
    return memcmp(y, want, sizeof y) == 0;
}

static int probe_bf16(void) {
    float x[T_][I_], a[S_][R_][I_], b[S_][O_][R_], y[T_][O_], want[T_][O_];
    uint16_t x16[T_][I_], a16[S_][R_][I_], pairs16[S_][R_ / 2][O_][2], y16[T_][O_];
    probe_case(x, a, b, y, want);
    for (int t = 0; t < T_; t++) {
        for (int i = 0; i < I_; i++) x16[t][i] = to_bf16(x[t][i]);
        for (int o = 0; o < O_; o++) y16[t][o] = to_bf16(y[t][o]);
    }
    for (int s = 0; s < S_; s++)
        for (int r = 0; r < R_; r++) {
            for (int i = 0; i < I_; i++) a16[s][r][i] = to_bf16(a[s][r][i]);
            for (int o = 0; o < O_; o++) pairs16[s][r / 2][o][r % 2] = to_bf16(b[s][o][r]);
        }
    if (graft_lora_add_bf16(&x16[0][0], I_, &y16[0][0], O_, &a16[0][0][0], &pairs16[0][0][0][0], probe_rows,
                            probe_slots, 2, T_, S_, I_, RANK_, SLICES_, probe_offsets, 1.f) != 2)
        return 0;
    for (int t = 0; t < T_; t++)
        for (int o = 0; o < O_; o++)
            if (from_bf16(y16[t][o]) != want[t][o])
                return 0;
    return 1;
}

/* Of the functions in `which` (HAS_FP32 | HAS_BF16), those this host has that gave the exact sums of a
 * small case. graft runs it in a child process, one per function: an instruction the CPU refuses kills the
 * child, never a server, nor the other function's probe. */
int64_t graft_lora_self_test(int64_t which) {
    const int64_t has = graft_lora_host_features() & which;
    return (has & HAS_FP32 && probe_f32() ? HAS_FP32 : 0) | (has & HAS_BF16 && probe_bf16() ? HAS_BF16 : 0);
}
