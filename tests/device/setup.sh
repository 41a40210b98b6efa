# Sourced by tests/device/run.sh and experiments.sh on the GPU machine
# (repository root, .device carried): installs the gpufault wheel and the
# dependency wheels the image lacks into /tmp/gf-site (nothing
# system-wide), checks that pyctl is imported from there and not from this
# checkout (whose pyctl/ holds sources only), unpacks the toolkit's
# crt/mma.h for the WMMA hook. Returns 2 on failure.
B=.device
ls "$B"/whl/gpufault-*.whl >/dev/null 2>&1 \
    || { echo "setup.sh: no gpufault wheel in $B/whl: run make device-bundle here and carry .device"; return 2; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# --target, not a venv: the image's python3 is itself a venv (torch), which a
# nested venv would not see. --no-deps: the image has click and the rest.
# Sourced twice in one command (run.sh, then experiments.sh): the same
# wheels are not installed again.
sums=$(cat "$B"/whl/*.whl | sha256sum)
if [ "$(cat /tmp/gf-site/.wheels 2>/dev/null)" != "$sums" ]; then
    rm -rf /tmp/gf-site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/gf-site "$B"/whl/*.whl || { echo "setup.sh: wheel install failed"; return 2; }
    echo "$sums" >/tmp/gf-site/.wheels
fi
# The wheel's pyctl first; the checkout only for tests.device; PYTHONSAFEPATH
# (3.11+): `python -m` and scripts never prepend the cwd (this checkout's pyctl).
export PYTHONPATH=/tmp/gf-site:$PWD PYTHONSAFEPATH=1 PATH=/tmp/gf-site/bin:$PATH
python3 -c 'import sys, pyctl; sys.exit(not pyctl.__file__.startswith("/tmp/gf-site/"))' \
    || { echo "setup.sh: pyctl is not imported from the wheel"; return 2; }
# crt/mma.h for pyctl/hooks/wmma_flip.py's WMMA back end (its PTX back end needs none).
crt=$(ls "$B"/extra/nvidia_cuda_crt-*.whl 2>/dev/null | head -1)
if [ -n "$crt" ]; then
    python3 - "$crt" <<'PY' && export GF_CUDA_INCLUDE=/tmp/gf-crt/include
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        if "/include/crt/" in info.filename:
            info.filename = "include/crt/" + info.filename.split("/include/crt/", 1)[1]
            z.extract(info, "/tmp/gf-crt")
PY
fi
# No tracefs mount here: the engine and the Xid monitor need none, and a
# mount made by the harness once hid that they did.
