/* cblas_sgemm that sends matrix-vector products to cblas_sgemv (kernels/cpu/gemv_shim.py).
 *
 * MLX's CPU matmul always calls cblas_sgemm. OpenBLAS 0.3.21 (Debian 12) runs a 1-row
 * product through its packing GEMM driver, 3-5x slower than its own sgemv (measured on 2
 * cores: 1 x 1024 by 1024 x 1024 180 vs 33 us; a 248,320 x 1024 LM head 77 vs 21 ms), and
 * a batch-1 decode step is nothing but such products. Preloaded before OpenBLAS, this
 * definition wins the symbol; a product with M == 1 or N == 1 in row-major order becomes
 * one sgemv, everything else goes on to the next cblas_sgemm in the search order.
 *
 * Row-major C[M, N] = alpha * op(A)[M, K] op(B)[K, N] + beta * C:
 *   M == 1: C's row = op(B)^T x with x = op(A)'s row (stride 1, or lda when A is
 *           transposed: A is stored [K, 1]);
 *   N == 1: C's column (stride ldc) = op(A) x with x = op(B)'s column (stride ldb, or 1
 *           when B is transposed: B is stored [1, K]).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *,
                         int, float, float *, int);

static sgemm_fn next_sgemm(void) {
    static sgemm_fn fn = NULL;
    if (fn == NULL) fn = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    return fn;
}

static sgemv_fn next_sgemv(void) {
    static sgemv_fn fn = NULL;
    if (fn == NULL) fn = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    return fn;
}

/* The shim's own marker: kernels/cpu/gemv_shim.py checks that it is the one loaded. */
int deltaserve_gemv_shim_version(void) { return 1; }

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
    sgemv_fn gemv = next_sgemv();
    int vector = (m == 1 || n == 1) && m > 0 && n > 0 && k > 0;
    if (order == ROW_MAJOR && vector && gemv != NULL) {
        if (m == 1) {
            int inc_x = trans_a == NO_TRANS ? 1 : lda;
            if (trans_b == NO_TRANS) /* B stored [K, N]: y = B^T x */
                gemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_x, beta, c, 1);
            else /* B stored [N, K]: y = B x */
                gemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_x, beta, c, 1);
        } else {
            int inc_x = trans_b == NO_TRANS ? ldb : 1;
            if (trans_a == NO_TRANS) /* A stored [M, K]: y = A x */
                gemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, inc_x, beta, c, ldc);
            else /* A stored [K, M]: y = A^T x */
                gemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, inc_x, beta, c, ldc);
        }
        return;
    }
    next_sgemm()(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
