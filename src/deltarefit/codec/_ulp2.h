/* Format 2's ulp class (encodings 6 ulp2 and 7 ulp2_hist) in the native extension: the Python entry points
 * _ulp2.c defines and _native.c lists in its method table. */
#ifndef DELTAREFIT_ULP2_H
#define DELTAREFIT_ULP2_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *py_ulp2_encode(PyObject *self, PyObject *args);
PyObject *py_ulp2_decode(PyObject *self, PyObject *args);
PyObject *py_ulp2_kernel(PyObject *self, PyObject *args);
PyObject *py_ulp2_kernels(PyObject *self, PyObject *noargs);
PyObject *py_ulp2_timing(PyObject *self, PyObject *noargs);

#endif
