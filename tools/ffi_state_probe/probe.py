"""Runs probe.cu's stateful FFI target (see there): two instances per jitted program, called three times, plain
and inside lax.scan; prints what each instance's counter reads. Expected: (1, 1), (2, 2), (3, 3) for the plain
program, a fresh program's instances counting from 1 again, and the scan's one instance 1-4 then 5-8 (all seen on
an H200 with jax 0.11.2, session 57).

    python3 tools/ffi_state_probe/probe.py [/tmp/libffi_state_probe.so]
"""

import ctypes
import sys

import jax
import jax.numpy as jnp


def capsule(address):
    """A PyCapsule holding a data pointer (the type id / type info, which XLA reads and fills)."""
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new(address, None, None)


def main():
    lib = ctypes.cdll.LoadLibrary(sys.argv[1] if len(sys.argv) > 1 else "/tmp/libffi_state_probe.so")
    lib.probe_type_id.restype = ctypes.c_void_p
    lib.probe_type_info.restype = ctypes.c_void_p
    jax.ffi.register_ffi_type("jax_flash_probe_state", {"type_id": capsule(lib.probe_type_id()),
                                                        "type_info": capsule(lib.probe_type_info())}, platform="CUDA")
    jax.ffi.register_ffi_target("jax_flash_probe", {"instantiate": jax.ffi.pycapsule(lib.ProbeInstantiate),
                                                    "execute": jax.ffi.pycapsule(lib.ProbeExecute)}, platform="CUDA")
    call = jax.ffi.ffi_call("jax_flash_probe", jax.ShapeDtypeStruct((), jnp.int32))
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")

    plain = jax.jit(lambda x: (call(x), call(x + 1)))
    for i in range(3):
        print("plain program, call", i + 1, [int(v) for v in plain(jnp.ones(4))])
    other = jax.jit(lambda x: (call(x * 2), call(x - 1)))
    print("another program, call 1", [int(v) for v in other(jnp.ones(4))])

    def body(carry, _):
        return carry + 1, call(carry)
    looped = jax.jit(lambda x: jax.lax.scan(body, x, None, length=4)[1])
    for i in range(2):
        print("scan of 4, call", i + 1, [int(v) for v in looped(jnp.ones(4))])


if __name__ == "__main__":
    main()
