# Sourced by the device scripts that run this checkout's pyctl (its build
# outputs carried in pyctl/data) rather than the wheel: the repository root
# as cwd and PYTHONPATH, $OUT made, and $LIBCUDA the real driver's file as
# the dynamic loader finds it.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 GPUFAULT_NO_EARLY_LOAD=1
LIBCUDA=$(python3 - <<'PY'
import ctypes, os
ctypes.CDLL("libcuda.so.1")
for line in open("/proc/self/maps"):
    if "libcuda.so" in line:
        print(os.path.realpath(line.split()[-1])); break
PY
)
