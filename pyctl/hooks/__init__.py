"""In-process fault hooks: VRAM pressure, Tensor Core precision perturbation,
a WMMA bit-flip kernel, and an LD_PRELOAD shim (pyctl/hooks/preload/)."""
