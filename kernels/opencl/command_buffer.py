"""A decode step's launches recorded once and replayed with one call: `cl_khr_command_buffer` through the ICD
loader (pyopencl 2026.1 does not wrap it).

Replaying 227 launches from Python costs the 1.5b 0.8-1.3 ms of host time a token on PoCL and Intel's CPU
runtime (each `enqueue_nd_range_kernel` 3-5 us, nearly all of it the runtime's own). A recorded command captures
its kernel's arguments when it is recorded, so the plan records again whenever it binds new arguments (the KV
pool's arrays grew: `DecodePlan._ensure`). Each command waits on the previous one's sync point: the step's
kernels run in their list's order on any queue, in-order or not.

Opt-in (`LOCALLLM_OPENCL_COMMAND_BUFFER=1`), because the one runtime here that has the extension gains nothing:
Intel's CPU runtime 2026.2 takes 1.2-1.7 ms to enqueue the 1.5b's recorded step, against 1.0 ms for the 227
launches one by one (measured gated, tools/opencl_host_profile.py's method), and the step ran at half the
speed (1.7 against 3.3 tokens/s); PoCL 3.0's PyPI build lacks it, and
no GPU driver has been measured with it yet. Where it is on and the device reports the extension with queue
properties ours has, a step is one enqueue; anywhere else the plan replays its list with
`enqueue_nd_range_kernel`, which gives the same bits (tests check both on the same device).
"""

from __future__ import annotations

import ctypes
import os
import weakref

from localllm.kernels.opencl.device import _opencl_library

EXTENSION = "cl_khr_command_buffer"
CL_DEVICE_COMMAND_BUFFER_REQUIRED_QUEUE_PROPERTIES_KHR = 0x12AA
CL_QUEUE_PROPERTIES = 0x1093

_vp, _u32, _i32, _sz = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32, ctypes.c_size_t
_P_i32, _P_u32, _P_sz, _P_vp = (ctypes.POINTER(t) for t in (_i32, _u32, _sz, _vp))
_SIGNATURES = {
    # cl_command_buffer_khr clCreateCommandBufferKHR(num_queues, queues, properties, errcode_ret)
    "clCreateCommandBufferKHR": (_vp, [_u32, _P_vp, _vp, _P_i32]),
    # clCommandNDRangeKernelKHR(command_buffer, command_queue, properties, kernel, work_dim, global_offset,
    #     global_size, local_size, num_sync_points, sync_point_wait_list, sync_point, mutable_handle)
    "clCommandNDRangeKernelKHR": (_i32, [_vp, _vp, _vp, _vp, _u32, _vp, _P_sz, _P_sz, _u32, _P_u32, _P_u32, _vp]),
    "clFinalizeCommandBufferKHR": (_i32, [_vp]),
    # clEnqueueCommandBufferKHR(num_queues, queues, command_buffer, num_events, event_wait_list, event)
    "clEnqueueCommandBufferKHR": (_i32, [_u32, _vp, _vp, _u32, _vp, _vp]),
    "clReleaseCommandBufferKHR": (_i32, [_vp]),
}


def enabled() -> bool:
    return os.environ.get("LOCALLLM_OPENCL_COMMAND_BUFFER", "0") in ("1", "on", "yes")


class CommandBufferError(RuntimeError):
    pass


class _Api:
    """The extension's entry points for one platform (clGetExtensionFunctionAddressForPlatform)."""

    def __init__(self, lib, platform_ptr: int):
        get = lib.clGetExtensionFunctionAddressForPlatform
        get.restype, get.argtypes = _vp, [_vp, ctypes.c_char_p]
        for name, (res, args) in _SIGNATURES.items():
            addr = get(_vp(platform_ptr), name.encode())
            if not addr:
                raise CommandBufferError(f"{name} is not exported by the platform")
            setattr(self, name, ctypes.CFUNCTYPE(res, *args)(addr))


_apis: dict[int, _Api | None] = {}


def _device_u64(lib, device_ptr: int, param: int) -> int | None:
    value, size = ctypes.c_uint64(0), _sz(0)
    fn = lib.clGetDeviceInfo
    fn.restype, fn.argtypes = _i32, [_vp, _u32, _sz, _vp, _P_sz]
    if fn(_vp(device_ptr), param, 8, ctypes.byref(value), ctypes.byref(size)) != 0:
        return None
    return value.value


def api_for(queue) -> _Api | None:
    """The entry points where `queue`'s device records command-buffers our queue may run, else None."""
    if not enabled():
        return None
    device = queue.device
    if EXTENSION not in device.extensions.split():
        return None
    key = device.int_ptr
    if key not in _apis:
        api = None
        lib = _opencl_library()
        if lib is not None:
            required = _device_u64(lib, device.int_ptr, CL_DEVICE_COMMAND_BUFFER_REQUIRED_QUEUE_PROPERTIES_KHR)
            have = queue.get_info(CL_QUEUE_PROPERTIES)
            if required is not None and required & ~int(have) == 0:
                try:
                    api = _Api(lib, device.platform.int_ptr)
                except (CommandBufferError, AttributeError):
                    api = None
        _apis[key] = api
    return _apis[key]


def _check(code: int, what: str) -> None:
    if code != 0:
        raise CommandBufferError(f"{what} failed with OpenCL error {code}")


def _release(api: _Api, handle: int, _queue) -> None:
    # _queue: kept alive by the finalizer until the command-buffer made on it is released
    api.clReleaseCommandBufferKHR(_vp(handle))


class CommandBuffer:
    """`launches` ([(kernel, global, local)], their arguments as bound now) recorded on `queue`'s device;
    `enqueue()` runs them all, in order, behind whatever the (in-order) queue holds."""

    def __init__(self, api: _Api, queue, launches):
        self.api = api
        self._queue_ptr = _vp(queue.int_ptr)
        err = _i32(0)
        queues = (_vp * 1)(queue.int_ptr)
        handle = api.clCreateCommandBufferKHR(1, queues, None, ctypes.byref(err))
        _check(err.value, "clCreateCommandBufferKHR")
        self._handle = _vp(handle)
        self._finalizer = weakref.finalize(self, _release, api, handle, queue)
        prev, point = _u32(0), _u32(0)
        for i, (kernel, gsize, lsize) in enumerate(launches):
            dims = len(gsize)
            g = (_sz * dims)(*gsize)
            local = (_sz * dims)(*lsize) if lsize is not None else None
            _check(api.clCommandNDRangeKernelKHR(self._handle, None, None, _vp(kernel.int_ptr), dims, None, g, local,
                                                 1 if i else 0, ctypes.byref(prev) if i else None,
                                                 ctypes.byref(point), None),
                   f"recording {kernel.function_name}")
            prev = _u32(point.value)
        _check(api.clFinalizeCommandBufferKHR(self._handle), "clFinalizeCommandBufferKHR")
        self.commands = len(launches)

    def enqueue(self) -> None:
        # NULL queues: the queue it was recorded for
        _check(self.api.clEnqueueCommandBufferKHR(0, None, self._handle, 0, None, None), "clEnqueueCommandBufferKHR")

    def release(self) -> None:
        self._finalizer()


def record(queue, launches) -> CommandBuffer | None:
    """The launches as a command-buffer where the device offers one (None elsewhere, or if recording fails)."""
    api = api_for(queue)
    if api is None or not launches:
        return None
    try:
        return CommandBuffer(api, queue, launches)
    except CommandBufferError:
        return None
