"""The OpenCL backend (pyopencl): consumer and Apple GPUs, and PoCL's CPU device wherever there is no GPU.

`device.py` finds devices by name and builds programs cached per device; `formats.py` is this backend's kernel
table over the backend-neutral format table (`kernels/formats.py`), with the kernels in `formats.cl`; `ops.py`
(kernels in `ops.cl`) has the decoder's other operations on device arrays, which stay there until `to_host`.
Importing this package imports neither pyopencl nor an OpenCL runtime: that happens when a device is opened.
"""
