"""PJRT through JAX: a client's devices, compiling StableHLO text for them (through the on-disk
cache, compile_cache.py), putting host arrays on them and executing with donated buffers.

`PjrtDevice` is one device: its values are single buffers. `PjrtMesh` is the N devices of one
tensor-parallel instance (docs/design.md#tensor-parallelism): a program lowered for N devices
is compiled with N partitions (XLA's SPMD partitioner), and every value is a tuple of N
per-device buffers, a weight's shards or a replicated input's copies. Both hide the small API
differences between jax 0.7 and newer releases.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where a JAX device needs it: the C API runtime (capi.py) builds on this
# module's bases in a process that may hold no numpy (runtime/stdlib_runner.py).



log = logging.getLogger("triton_tlaloc.runtime")


CPU_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def cpu_devices(n: int) -> None:
    """Give this process's CPU client n devices (XLA_FLAGS), when JAX is not imported yet and
    no count is set; a client already made keeps its devices (PjrtMesh then names the flag)."""
    import sys

    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "jax" not in sys.modules and CPU_DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = with_cpu_devices(flags, n)


def with_cpu_devices(flags: str, n: int) -> str:
    """XLA_FLAGS giving the CPU client n devices, any count in `flags` replaced."""
    kept = [f for f in flags.split() if not f.startswith(CPU_DEVICE_FLAG)]
    return " ".join([*kept, f"{CPU_DEVICE_FLAG}={n}"])


def x64_mode(on: bool):
    """A context with JAX's 64-bit types on (when `on`): jax.experimental.enable_x64 in jax
    0.7, jax.enable_x64(True) in the releases that dropped it (0.10 and the GPU image's)."""
    import contextlib

    if not on:
        return contextlib.nullcontext()
    try:
        from jax.experimental import enable_x64
    except ImportError:
        import jax

        return jax.enable_x64(True)
    return enable_x64()


class _Compiling:
    """Compiling for a client's device list with the options its subclass set."""

    backend: object
    device_list: object
    _compile_options: object

    def compile(self, text: str):
        return self.backend.compile_and_load(text, self.device_list, self._compile_options)

    def serialize(self, executable) -> bytes:
        return self.backend.serialize_executable(executable)

    def deserialize(self, blob: bytes):
        return self.backend.deserialize_executable(blob, self.device_list, None)


class OneDevice:
    """What a runtime asks of its devices whatever their number (PjrtMesh has the same), as
    one device answers it: a value is a single buffer."""

    size = 1

    def put(self, array: np.ndarray):
        raise NotImplementedError

    def put_shards(self, shards: list[np.ndarray]):
        return self.put(shards[0])

    def put_split(self, array: np.ndarray, axis: int | None):
        return self.put(array)

    @staticmethod
    def first(value):
        return value

    @staticmethod
    def nbytes(value) -> list[int]:
        return [value.nbytes]


class PjrtDevice(OneDevice, _Compiling):
    """One PJRT client and device, reached through JAX; hides the small API differences between
    jax 0.7 and newer releases."""

    def __init__(self, platform: str = "cpu", device_index: int = 0):
        import jax
        import jax.extend.backend as jeb
        from jax._src.lib import xla_client as xc

        self.jax = jax
        self.xc = xc
        self.backend = jeb.get_backend(platform)
        self.device = self.backend.local_devices()[device_index]
        self.platform = platform
        self.device_list = xc.DeviceList((self.device,))
        self._compile_options = jeb.get_compile_options(num_replicas=1, num_partitions=1)

    @property
    def client_identity(self) -> str:
        """The platform, its version and the jax/jaxlib versions: what a compile depends on
        besides the text and the devices."""
        import jaxlib

        version = getattr(self.backend, "platform_version", "")
        identity = (f"{self.platform}|{version}|jax {self.jax.__version__}"
                    f"|jaxlib {jaxlib.__version__}")
        # XLA_FLAGS change the code compiled (optimization levels, fast math): another
        # executable. The CPU device count does not (a device's key says which device), and
        # no flags keeps the keys caches written without flags hold.
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith(CPU_DEVICE_FLAG)]
        return identity + (f"|XLA_FLAGS {' '.join(sorted(flags))}" if flags else "")

    @property
    def cache_identity(self) -> str:
        # A compiled program keeps the device it was compiled for: another device's is another
        # executable (device 0's key is the one caches made before held).
        device = f"|device {self.device.id}" if self.device.id else ""
        return f"{self.client_identity}{device}"

    def put(self, array: np.ndarray):
        # buffer_from_pyval (2.4 us) is gone from newer jaxlib; device_put (35 us) works in both.
        if hasattr(self.backend, "buffer_from_pyval"):
            return self.backend.buffer_from_pyval(array, self.device)
        if array.dtype.itemsize == 8:  # device_put narrows 64-bit values unless x64 is on
            with x64_mode(True):
                return self.jax.device_put(array, self.device)
        return self.jax.device_put(array, self.device)

    def zeros(self, specs: list[tuple[tuple[int, ...], np.dtype]]) -> list:
        """Zeroed buffers made on the device by one jitted program (one compile for all)."""
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import SingleDeviceSharding

        make = self.jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype in specs),
                            out_shardings=SingleDeviceSharding(self.device))
        # 64-bit zeros (a program's int64 state) stay 64-bit only with x64 on
        with x64_mode(any(np.dtype(dtype).itemsize == 8 for _, dtype in specs)):
            return list(make())

    @staticmethod
    def execute(executable, args: list):
        if hasattr(executable, "execute"):
            return executable.execute(args)
        results = executable.execute_sharded([[a] for a in args])  # newer jaxlib
        return [arrs[0] for arrs in results.disassemble_into_single_device_arrays()]

    @property
    def devices(self) -> tuple:
        return (self.device,)

    @staticmethod
    def host(value, axis: int | None) -> np.ndarray:
        """A host copy of a value (never a view: a live view of a CPU buffer stops donation)."""
        import numpy as np

        return np.array(value, copy=True)

    @staticmethod
    def addresses(value) -> tuple[int, ...]:
        return (value.unsafe_buffer_pointer(),)

    @staticmethod
    def wait(buffer) -> None:
        """Until one buffer (a value's, or one device's of a value) is computed."""
        buffer.block_until_ready()

    @staticmethod
    def read(buffer) -> np.ndarray:
        """A host copy of one buffer (never a view: a live view of a CPU buffer stops
        donation)."""
        import numpy as np

        return np.array(buffer, copy=True)


class ManyDevices:
    """What a runtime asks of its devices as the N devices of one tensor-parallel instance
    answer it: every value a tuple of N per-device buffers (a shard or a copy on each)."""

    devices: tuple

    @property
    def size(self) -> int:
        return len(self.devices)

    def put(self, array: np.ndarray) -> tuple:
        raise NotImplementedError

    def put_shards(self, shards: list[np.ndarray]) -> tuple:
        raise NotImplementedError

    def put_split(self, array: np.ndarray, axis: int | None) -> tuple:
        """`array` as the program sees it, split along `axis` into equal shards (device j's
        the j-th), or copied on every device when `axis` is None."""
        import numpy as np

        if axis is None:
            return self.put(array)
        return self.put_shards(np.split(array, self.size, axis=axis))

    @staticmethod
    def first(value: tuple):
        """Device 0's buffer of a value (a replicated output is the same on each)."""
        return value[0]

    @staticmethod
    def nbytes(value: tuple) -> list[int]:
        return [b.nbytes for b in value]


class PjrtMesh(ManyDevices, _Compiling):
    """The N devices of one tensor-parallel instance of a PJRT client: programs compiled with
    N partitions, each value a tuple of per-device buffers (a shard or a copy on each)."""

    def __init__(self, platform: str, device_indices: tuple[int, ...]):
        import jax
        import jax.extend.backend as jeb
        import numpy as np
        from jax._src.lib import xla_client as xc

        self.jax = jax
        self.backend = jeb.get_backend(platform)
        local = self.backend.local_devices()
        missing = [i for i in device_indices if not 0 <= i < len(local)]
        if missing or len(set(device_indices)) != len(device_indices):
            raise ValueError(
                f"devices {list(device_indices)}: {platform} has {len(local)} device(s) "
                f"(0..{len(local) - 1}), each named once"
                + (f"; on CPU, XLA_FLAGS={CPU_DEVICE_FLAG}=N before JAX starts gives N"
                   if platform == "cpu" else ""))
        self.devices = tuple(local[i] for i in device_indices)
        self.platform = platform
        self.device_list = xc.DeviceList(self.devices)
        options = jeb.get_compile_options(num_replicas=1, num_partitions=len(self.devices))
        options.executable_build_options.use_spmd_partitioning = True
        options.device_assignment = xc.DeviceAssignment.create(
            np.array([[d.id for d in self.devices]]))
        self._compile_options = options
        self._one = [PjrtDevice(platform, i) for i in device_indices]

    @property
    def cache_identity(self) -> str:
        # A compiled SPMD program keeps its device assignment: the same text for other devices
        # is another executable.
        ids = ",".join(str(d.id) for d in self.devices)
        return f"{self._one[0].client_identity}|devices {ids}"

    def put(self, array: np.ndarray) -> tuple:
        """A copy of `array` on every device (a replicated input)."""
        return tuple(one.put(array) for one in self._one)

    def put_shards(self, shards: list[np.ndarray]) -> tuple:
        """Shard j on device j."""
        assert len(shards) == self.size, (len(shards), self.size)
        return tuple(one.put(a) for one, a in zip(self._one, shards))

    @staticmethod
    def host(value: tuple, axis: int | None) -> np.ndarray:
        """A host copy of a value as the program sees it: the shards joined along `axis`
        (device 0's first), or device 0's copy of a replicated value when `axis` is None."""
        import numpy as np

        if axis is None:
            return np.array(value[0], copy=True)
        return np.concatenate([np.asarray(b) for b in value], axis=axis)

    def zeros(self, specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[tuple]:
        """Zeroed values of the shard shapes `specs`, one on each device."""
        per_device = [one.zeros(specs) for one in self._one]
        return [tuple(bufs) for bufs in zip(*per_device)]

    @staticmethod
    def execute(executable, args: list[tuple]) -> list[tuple]:
        results = executable.execute_sharded([list(a) for a in args])
        return [tuple(arrs) for arrs in results.disassemble_into_single_device_arrays()]

    @staticmethod
    def addresses(value: tuple) -> tuple[int, ...]:
        return tuple(b.unsafe_buffer_pointer() for b in value)

    wait = staticmethod(PjrtDevice.wait)
    read = staticmethod(PjrtDevice.read)


def open_devices(artifact, platform: str, device_index: int,
                 devices: tuple[int, ...] | None, plugin: str | None = None):
    """The device, or the devices, an artifact's programs run on: `devices` (default 0..N-1)
    for an artifact lowered for N devices, which must name exactly N. With `plugin` (a PJRT
    plugin's path, or "" for the one found by default), the device or devices of that plugin
    reached through its C API, with no JAX (capi.CapiDevice, capi.CapiMesh)."""
    n = artifact.devices
    if devices is None:
        devices = (device_index,) if n == 1 else tuple(range(n))
    if len(devices) != n:
        raise ValueError(f"{artifact.path}: its programs are lowered for {n} device(s) "
                         f"(model.tensorParallel); {len(devices)} given: {list(devices)}")
    if plugin is not None:
        from .capi import CapiDevice, CapiMesh

        return (CapiDevice(plugin or None, devices[0]) if n == 1
                else CapiMesh(plugin or None, tuple(devices)))
    return PjrtDevice(platform, devices[0]) if n == 1 else PjrtMesh(platform, tuple(devices))


def instance_devices(listed: str, per_instance: int, instance: int, device: int,
                     own_client: bool = False) -> tuple:
    """The devices of one instance of a model whose programs run on `per_instance` devices:
    group `instance` of the `devices` parameter (comma-separated, per_instance a group), or of
    0, 1, 2, ... when it is empty. With no list, an instance of a one-device artifact keeps the
    device its instance group names, and an instance whose process has a client of its own
    (`own_client`: the CPU, whose devices are the process's) takes the first devices."""
    if not listed.strip():
        if per_instance == 1:
            return (device,)
        first = 0 if own_client else instance * per_instance
        return tuple(range(first, first + per_instance))
    try:
        ids = [int(x) for x in listed.split(",")]
    except ValueError:
        raise ValueError(f"devices {listed!r}: expected comma-separated device numbers") from None
    group = ids[instance * per_instance:(instance + 1) * per_instance]
    if len(group) != per_instance:
        raise ValueError(f"devices {listed!r}: instance {instance} needs devices "
                         f"{instance * per_instance}..{(instance + 1) * per_instance - 1} of the "
                         f"list ({per_instance} for each instance), the list has {len(ids)}")
    return tuple(group)

