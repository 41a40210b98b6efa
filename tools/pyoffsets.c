/* Print the CPython struct offsets pyctl/symbols/pystack.py reads, from the
 * interpreter's own internal headers (offsetof, not guessed): build with
 *   cc -DPy_BUILD_CORE -I$PREFIX/include/python3.X -I$PREFIX/include/python3.X/internal
 * tests/test_pystack.py compiles it against each installed 3.11/3.12 and
 * checks pystack.OFFSETS against its output. 3.13+ needs none of this: the
 * runtime carries _Py_DebugOffsets. */
#define Py_BUILD_CORE 1
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include "pycore_frame.h"
#include "pycore_interp.h"
#include "pycore_runtime.h"

#define P(name, v) printf("%s %zu\n", name, (size_t)(v))

int main(void) {
    P("runtime_interpreters_head", offsetof(_PyRuntimeState, interpreters.head));
    P("interp_next", offsetof(PyInterpreterState, next));
    P("interp_threads_head", offsetof(PyInterpreterState, threads.head));
    P("tstate_next", offsetof(PyThreadState, next));
    P("tstate_native_thread_id", offsetof(PyThreadState, native_thread_id));
    P("tstate_cframe", offsetof(PyThreadState, cframe));
    P("cframe_current_frame", offsetof(_PyCFrame, current_frame));
    P("frame_code", offsetof(_PyInterpreterFrame, f_code));
    P("frame_previous", offsetof(_PyInterpreterFrame, previous));
    P("frame_prev_instr", offsetof(_PyInterpreterFrame, prev_instr));
    P("frame_owner", offsetof(_PyInterpreterFrame, owner));
#if PY_MINOR_VERSION == 11
    P("frame_is_entry", offsetof(_PyInterpreterFrame, is_entry));
#endif
    P("code_filename", offsetof(PyCodeObject, co_filename));
    P("code_name", offsetof(PyCodeObject, co_name));
    P("code_qualname", offsetof(PyCodeObject, co_qualname));
    P("code_linetable", offsetof(PyCodeObject, co_linetable));
    P("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
    P("code_code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
    P("unicode_state", offsetof(PyASCIIObject, state));
    P("unicode_length", offsetof(PyASCIIObject, length));
    P("unicode_ascii_size", sizeof(PyASCIIObject));
    P("unicode_compact_size", sizeof(PyCompactUnicodeObject));
    P("bytes_size", offsetof(PyVarObject, ob_size));
    P("bytes_sval", offsetof(PyBytesObject, ob_sval));
    return 0;
}
