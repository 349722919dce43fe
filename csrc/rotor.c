/*
 * autopar._rotor: the Rotor optimal-checkpointing dynamic program, in C.
 *
 * The model, the recurrence and the schedule semantics are documented once, in
 * autopar/solver/rotor.py; this file is the fast twin of `_dp_python` there and must
 * stay operation-for-operation identical to it (same loop order, same additions in the same
 * order, same strict-< tie-breaking), so both produce bit-identical tables.
 *
 * solve(fwd, bwd, act, saved, fwd_tmp, bwd_tmp, mem, rows, num_rows) -> (cost: bytes, choice: bytes)
 *   fwd, bwd      L floats, seconds per stage
 *   act           L+1 ints, slots of activation k (k = 0 is the chain input)
 *   saved         L ints, slots of stage i's tape (includes its output act[i+1])
 *   fwd_tmp, bwd_tmp  L ints, transient slots of stage i's forward / backward
 *   mem           int >= 0, slots available to the whole chain besides its input
 *   rows          L*(L+1)/2 ints: the stored row of subchain (s, t), at index tri(s, t) =
 *                 t*(t+1)/2 + s. Subchains with the same stages (a chain of repeated blocks)
 *                 share one row, computed at the first of them in the DP's order (d = t - s
 *                 ascending, then s) in that subchain's own indices; `choice` then holds the
 *                 checkpoint j of that first subchain (the Python caller shifts it).
 *   num_rows      int: how many stored rows (every entry of `rows` is below it)
 * Each stored row holds mem+1 entries indexed by the memory m: cost is float64 seconds (inf =
 * infeasible), choice is int32 (0 = infeasible, -1 = save stage s's tape, j > 0 = checkpoint
 * act j).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static size_t tri(size_t s, size_t t) { return t * (t + 1) / 2 + s; }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Fill `out` (n entries) from a Python sequence of floats (is_int = 0) or ints (is_int = 1). */
static int read_seq(PyObject *seq, Py_ssize_t n, const char *what, int is_int,
                    double *dout, int64_t *iout) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, expected %zd", what,
                     PySequence_Fast_GET_SIZE(fast), n);
        Py_DECREF(fast);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (is_int) {
            long long v = PyLong_AsLongLong(items[i]);
            if (v == -1 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
            if (v < 0) {
                PyErr_Format(PyExc_ValueError, "%s[%zd] = %lld is negative", what, i, v);
                Py_DECREF(fast);
                return -1;
            }
            iout[i] = (int64_t)v;
        } else {
            double v = PyFloat_AsDouble(items[i]);
            if (v == -1.0 && PyErr_Occurred()) { Py_DECREF(fast); return -1; }
            if (!isfinite(v) || v < 0.0) {
                PyErr_Format(PyExc_ValueError, "%s[%zd] = %R is not a finite time >= 0", what,
                             i, items[i]);
                Py_DECREF(fast);
                return -1;
            }
            dout[i] = v;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* row[m] = min(row[m], (acc + right[m]) + left[m]) for m in 0..n-1, strict < keeping the earlier
 * choice. Branch-free, over distinct rows (restrict), so the compiler vectorises it. */
static void relax(double *restrict row, int32_t *restrict ch, const double *restrict right,
                  const double *restrict left, int64_t n, double acc, int32_t j) {
    for (int64_t m = 0; m < n; m++) {
        const double v = (acc + right[m]) + left[m];
        const double cur = row[m];
        const int better = v < cur;
        row[m] = better ? v : cur;
        ch[m] = better ? j : ch[m];
    }
}

/* The recurrence; see rotor.py's module docstring for its derivation. R maps a subchain to its
 * stored row; a row already computed for an identical subchain is not computed again (`done`). */
static void rotor_dp(size_t L, int64_t M, const double *fwd, const double *bwd,
                     const int64_t *A, const int64_t *S, const int64_t *Ft, const int64_t *Bt,
                     const int64_t *R, double *cost, int32_t *choice, int64_t *first, char *done) {
    const size_t W = (size_t)M + 1;
    for (size_t d = 0; d < L; d++) {
        for (size_t s = 0; s + d < L; s++) {
            const size_t t = s + d;
            const int64_t r = R[tri(s, t)];
            if (done[r]) continue;
            done[r] = 1;
            double *row = cost + (size_t)r * W;
            int32_t *ch = choice + (size_t)r * W;
            for (size_t m = 0; m < W; m++) { row[m] = INFINITY; ch[m] = 0; }

            /* Option "tape": forward stage s saving its tape, solve (s+1, t), backward s. */
            int64_t need = max64(A[t + 1] + S[s] + Ft[s], S[s] + A[s + 1] + A[s] + Bt[s]);
            if (d == 0) {
                const double v = fwd[s] + bwd[s];
                for (int64_t m = need; m <= M; m++) { row[m] = v; ch[m] = -1; }
            } else {
                const double *sub = cost + (size_t)R[tri(s + 1, t)] * W;
                const int64_t shift = S[s];
                for (int64_t m = need; m <= M; m++) {
                    const double v = sub[m - shift];
                    if (v < INFINITY) { row[m] = (fwd[s] + v) + bwd[s]; ch[m] = -1; }
                }
            }

            /* Option "checkpoint act j": run stages s..j-1 keeping only act j, solve (j, t),
             * drop act j, solve (s, j-1). */
            double acc = 0.0;
            int64_t adv = A[t + 1] + A[s + 1] + Ft[s];
            for (size_t j = s + 1; j <= t; j++) {
                acc += fwd[j - 1];
                if (j - 1 > s) adv = max64(adv, A[t + 1] + A[j - 1] + A[j] + Ft[j - 1]);
                const int64_t shift = A[j];
                const int64_t r_right = R[tri(j, t)], r_left = R[tri(s, j - 1)];
                /* Costs are finite exactly from a row's first finite entry on (more memory
                 * never removes a schedule), so candidates below these bounds are inf. */
                const int64_t lo = max64(max64(adv, shift), max64(first[r_right] + shift, first[r_left]));
                if (lo > M) continue;
                const double *right = cost + (size_t)r_right * W + (lo - shift);
                const double *left = cost + (size_t)r_left * W + lo;
                relax(row + lo, ch + lo, right, left, M - lo + 1, acc, (int32_t)j);
            }
            int64_t f = 0;
            while (f <= M && row[f] == INFINITY) f++;
            first[r] = f;
        }
    }
}

static PyObject *rotor_solve(PyObject *self, PyObject *args) {
    PyObject *o_fwd, *o_bwd, *o_act, *o_saved, *o_ftmp, *o_btmp, *o_rows;
    long long mem, num_rows;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOLOL", &o_fwd, &o_bwd, &o_act, &o_saved, &o_ftmp, &o_btmp,
                          &mem, &o_rows, &num_rows))
        return NULL;
    Py_ssize_t L = PySequence_Size(o_fwd);
    if (L < 0) return NULL;
    if (L < 1 || L > 46340) {
        PyErr_Format(PyExc_ValueError, "chain length %zd must be in [1, 46340]", L);
        return NULL;
    }
    if (mem < 0 || mem > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "mem = %lld slots must be in [0, 2**31 - 1]", mem);
        return NULL;
    }
    const size_t W = (size_t)mem + 1;
    const size_t rows = (size_t)L * ((size_t)L + 1) / 2;
    if (num_rows < 1 || (size_t)num_rows > rows) {
        PyErr_Format(PyExc_ValueError, "num_rows = %lld must be in [1, %zu]", num_rows, rows);
        return NULL;
    }
    if ((size_t)num_rows > (SIZE_MAX / 8) / W) return PyErr_NoMemory();
    const size_t n = (size_t)num_rows * W;

    double *fwd = PyMem_Malloc(sizeof(double) * 2 * (size_t)L);
    int64_t *ints = PyMem_Malloc(sizeof(int64_t) * (5 * (size_t)L + 1));
    if (fwd == NULL || ints == NULL) {
        PyMem_Free(fwd);
        PyMem_Free(ints);
        return PyErr_NoMemory();
    }
    double *bwd = fwd + L;
    int64_t *A = ints, *S = ints + L + 1, *Ft = S + L, *Bt = Ft + L;
    PyObject *cost = NULL, *choice = NULL, *result = NULL;
    int64_t *first = NULL, *R = NULL;
    char *computed = NULL;
    if (read_seq(o_fwd, L, "fwd", 0, fwd, NULL) || read_seq(o_bwd, L, "bwd", 0, bwd, NULL) ||
        read_seq(o_act, L + 1, "act", 1, NULL, A) || read_seq(o_saved, L, "saved", 1, NULL, S) ||
        read_seq(o_ftmp, L, "fwd_tmp", 1, NULL, Ft) || read_seq(o_btmp, L, "bwd_tmp", 1, NULL, Bt))
        goto done;
    R = PyMem_Malloc(sizeof(int64_t) * rows);
    if (R == NULL) { PyErr_NoMemory(); goto done; }
    if (read_seq(o_rows, (Py_ssize_t)rows, "rows", 1, NULL, R)) goto done;
    for (size_t i = 0; i < rows; i++)
        if (R[i] >= num_rows) {
            PyErr_Format(PyExc_ValueError, "rows[%zu] = %lld is not below num_rows = %lld", i,
                         (long long)R[i], num_rows);
            goto done;
        }
    /* Slot counts beyond mem can never fit; clamping keeps every sum far from overflow. */
    for (Py_ssize_t i = 0; i < 5 * L + 1; i++)
        if (ints[i] > mem + 1) ints[i] = mem + 1;

    first = PyMem_Malloc(sizeof(int64_t) * (size_t)num_rows);
    computed = PyMem_Calloc((size_t)num_rows, 1);
    if (first == NULL || computed == NULL) { PyErr_NoMemory(); goto done; }
    cost = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(double)));
    choice = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(int32_t)));
    if (cost == NULL || choice == NULL) goto done;
    double *c = (double *)PyBytes_AS_STRING(cost);
    int32_t *ch = (int32_t *)PyBytes_AS_STRING(choice);
    Py_BEGIN_ALLOW_THREADS
    rotor_dp((size_t)L, (int64_t)mem, fwd, bwd, A, S, Ft, Bt, R, c, ch, first, computed);
    Py_END_ALLOW_THREADS
    result = PyTuple_Pack(2, cost, choice);
done:
    Py_XDECREF(cost);
    Py_XDECREF(choice);
    PyMem_Free(fwd);
    PyMem_Free(ints);
    PyMem_Free(first);
    PyMem_Free(R);
    PyMem_Free(computed);
    return result;
}

static PyMethodDef rotor_methods[] = {
    {"solve", rotor_solve, METH_VARARGS,
     "solve(fwd, bwd, act, saved, fwd_tmp, bwd_tmp, mem, rows, num_rows) -> (cost: bytes, choice: bytes)\n"
     "Rotor DP tables, one stored row per distinct subchain; see autopar.solver.rotor."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef rotor_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "autopar._rotor",
    .m_doc = "Rotor optimal checkpointing DP (C twin of autopar.solver.rotor._dp_python).",
    .m_size = -1,
    .m_methods = rotor_methods,
};

PyMODINIT_FUNC PyInit__rotor(void) { return PyModule_Create(&rotor_module); }
