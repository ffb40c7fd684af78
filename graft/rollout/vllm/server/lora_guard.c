/* The fault guard of graft's LoRA kernel: a fault (SIGILL, SIGSEGV, SIGBUS, SIGFPE) while a thread runs the
 * kernel's rows jumps back to run_guarded, which restores the row it hit and returns its index; a fault
 * anywhere else is described in one line on stderr, then handed to the handler before ours (or the default
 * action: the process dies of it as it would have). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

#include "lora_kernel.h"

/* Set while this thread runs rows; the fault handler jumps back. Initial-exec: read in a signal handler,
 * where the general-dynamic model's first access in a thread may allocate. */
static __thread __attribute__((tls_model("initial-exec"))) sigjmp_buf *armed;
static __thread unsigned char *saved_row;
static __thread size_t saved_capacity;
static struct sigaction handed_on[4]; /* the handlers before ours, for SIGILL, SIGSEGV, SIGBUS, SIGFPE */
static const int guarded_signals[4] = {SIGILL, SIGSEGV, SIGBUS, SIGFPE};
static volatile sig_atomic_t fault_signal, fault_code;
static volatile uintptr_t fault_ip, fault_address;
static unsigned char fault_bytes[16];

static uintptr_t library_base(void) {
    Dl_info info;
    return dladdr((void *)library_base, &info) ? (uintptr_t)info.dli_fbase : 0;
}

static void write_hex(char **out, uintptr_t value) {
    char digits[16];
    int n = 0;
    do digits[n++] = "0123456789abcdef"[value & 15]; while ((value >>= 4) && n < 16);
    *(*out)++ = '0', *(*out)++ = 'x';
    while (n) *(*out)++ = digits[--n];
}

static void write_text(char **out, const char *text, size_t limit) {
    const size_t length = strnlen(text, limit);
    memcpy(*out, text, length), *out += length;
}

/* One line on stderr for a fault outside the kernel, naming the module and offset of the instruction and
 * its first bytes, so that a death says where it happened (write(2), no allocation; dladdr takes the
 * loader's lock, which a fault inside the loader would hold: that case is left to the default action). */
static void describe_foreign_fault(int sig, uintptr_t ip, uintptr_t address) {
    char line[640], *out = line;
    Dl_info where;
    const int known = dladdr((void *)ip, &where) && where.dli_fname != NULL;
    write_text(&out, "graft: fatal ", 32);
    write_text(&out, sig == SIGILL ? "SIGILL" : sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "SIGFPE", 8);
    write_text(&out, " at ip ", 8);
    write_hex(&out, ip);
    if (known) { /* the bytes of a module's mapped text are readable */
        write_text(&out, " = ", 4);
        write_text(&out, where.dli_fname, 400);
        write_text(&out, "+", 2);
        write_hex(&out, ip - (uintptr_t)where.dli_fbase);
        write_text(&out, " (bytes", 8);
        for (int k = 0; k < 8; k++) {
            write_text(&out, " ", 2);
            write_hex(&out, ((const unsigned char *)ip)[k]);
        }
        write_text(&out, ")", 2);
    }
    write_text(&out, ", address ", 12);
    write_hex(&out, address);
    write_text(&out, ": not in graft's LoRA kernel, handed on\n", 64);
    ssize_t ignored = write(STDERR_FILENO, line, (size_t)(out - line));
    (void)ignored;
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    const uintptr_t ip = (uintptr_t)((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP];
    sigjmp_buf *jump = armed;
    if (jump != NULL) {
        armed = NULL;
        fault_signal = sig, fault_code = info->si_code, fault_ip = ip, fault_address = (uintptr_t)info->si_addr;
        Dl_info where;
        memset(fault_bytes, 0, sizeof fault_bytes);
        if (dladdr((void *)ip, &where) && (uintptr_t)where.dli_fbase == library_base()) /* our text: readable */
            memcpy(fault_bytes, (const void *)ip, sizeof fault_bytes);
        siglongjmp(*jump, 1);
    }
    describe_foreign_fault(sig, ip, (uintptr_t)info->si_addr);
    for (int k = 0; k < 4; k++) {
        if (guarded_signals[k] != sig)
            continue;
        struct sigaction *before = &handed_on[k];
        if (before->sa_flags & SA_SIGINFO && before->sa_sigaction != NULL) {
            before->sa_sigaction(sig, info, context);
        } else if (before->sa_handler != SIG_DFL && before->sa_handler != SIG_IGN) {
            before->sa_handler(sig);
        } else {
            signal(sig, SIG_DFL); /* the faulting instruction runs again and takes the default action */
            if (info->si_code <= 0)
                raise(sig); /* sent, not a fault: nothing runs again */
        }
    }
}

/* Install the fault handler once per process (graft calls it as it loads the library); 0 on success. */
int64_t graft_lora_install_guard(void) {
    static int installed;
    if (installed)
        return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_fault;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    for (int k = 0; k < 4; k++)
        if (sigaction(guarded_signals[k], &ours, &handed_on[k]) != 0)
            return -1;
    installed = 1;
    return 0;
}

/* The last fault inside the kernel, as text (signal, code, where in this library, the bytes there). */
int64_t graft_lora_fault(char *text, int64_t size) {
    char bytes[16 * 3 + 1] = "";
    for (int k = 0; k < 16; k++)
        snprintf(bytes + 3 * k, 4, "%02x ", fault_bytes[k]);
    return snprintf(text, (size_t)size, "signal %d (code %d) at ip 0x%lx (the kernel's library + 0x%lx), address "
                    "0x%lx; bytes there %s", (int)fault_signal, (int)fault_code, (unsigned long)fault_ip,
                    (unsigned long)(fault_ip - library_base()), (unsigned long)fault_address, bytes);
}

/* Rows in order, each saved first: a fault restores the row it hit and returns its index. */
int64_t run_guarded(const struct call *c, row_function *row, size_t element) {
    const size_t row_bytes = (size_t)c->out_offsets[c->n_slices] * element;
    if (row_bytes > saved_capacity) {
        unsigned char *bigger = realloc(saved_row, row_bytes);
        if (bigger == NULL)
            return -1;
        saved_row = bigger, saved_capacity = row_bytes;
    }
    volatile int64_t index = 0;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0)) { /* no mask saved: a syscall a call saved; the fault path unblocks its own */
        sigset_t fault;
        sigemptyset(&fault);
        sigaddset(&fault, fault_signal);
        pthread_sigmask(SIG_UNBLOCK, &fault, NULL);
        memcpy((unsigned char *)c->y + c->rows[index] * c->y_stride * (int64_t)element, saved_row, row_bytes);
        return index;
    }
    armed = &jump;
    for (; index < c->n_rows; index++) {
        unsigned char *y_row = (unsigned char *)c->y + c->rows[index] * c->y_stride * (int64_t)element;
        memcpy(saved_row, y_row, row_bytes);
        row(c, index);
    }
    armed = NULL;
    return c->n_rows;
}
