"""The runtime's devices over a PJRT plugin's C API, with no JAX: the plugin is a shared
library (a wheel such as `xla-cpu-pjrt` carries XLA's CPU plugin) loaded through `pypjrt`, a
dependency-free ctypes client of the PJRT C API (docs/design.md#the-c-api-runtime).

`CapiDevice` is one device of such a plugin, with the methods the runtime asks of
`pjrt.PjrtDevice` (compile, serialize and load an executable, put host arrays, make zeroed
buffers, execute with the programs' donation, read values back, their addresses), so the
runtime, the engine and the batcher run unchanged over it. An executable's donation is the
program's own (its `tf.aliasing_output`): the pools given to a call are consumed and its
outputs take their place, as with JAX.

The plugin is found by `plugin_path`: a path given, else $TLALOC_PJRT_PLUGIN, else the CPU
plugin of an installed `xla-cpu-pjrt` wheel (`pip install triton-tlaloc[capi]`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifact.manifest import dtype_name, element_bytes, numpy_dtype
from .pjrt import ManyDevices, OneDevice

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("triton_tlaloc.runtime")

PLUGIN_ENV = "TLALOC_PJRT_PLUGIN"
# The CPU plugin wheel found by default: its package, and its library inside it
CPU_WHEEL = ("xla_plugins.xla_cpu_pjrt", "xla_cpu_pjrt.so")
# The oldest PJRT C API a plugin may answer with: the calls the runtime makes are all there
# (compile, buffers from host, execute with donation, serialize, to host) in 0.50 and later.
OLDEST_API = (0, 50)
# PJRT_Buffer_Type by StableHLO element type (the artifact's names: manifest.numpy_dtype)
BUFFER_TYPES = {"i1": 1, "i8": 2, "i16": 3, "i32": 4, "i64": 5, "ui8": 6, "ui16": 7,
                "ui32": 8, "f16": 10, "f32": 11, "f64": 12, "bf16": 16, "f8E4M3FN": 20}


class PluginError(RuntimeError):
    """A plugin that cannot be used: missing, not a PJRT plugin, or too old; names it."""


def plugin_path(given: str | os.PathLike | None = None) -> Path:
    """The plugin to load: `given`, else $TLALOC_PJRT_PLUGIN, else the installed CPU wheel's."""
    if given:
        where = f"--plugin {given}"
        path = Path(given)
    elif os.environ.get(PLUGIN_ENV):
        where = f"{PLUGIN_ENV}={os.environ[PLUGIN_ENV]}"
        path = Path(os.environ[PLUGIN_ENV])
    else:
        package, library = CPU_WHEEL
        spec = importlib.util.find_spec(package.split(".")[0])
        if spec is None or not spec.submodule_search_locations:
            raise PluginError(f"no PJRT plugin: give one (--plugin PATH, or {PLUGIN_ENV}) or "
                              f"install the CPU plugin wheel (pip install "
                              f"'triton-tlaloc[capi]', which brings xla-cpu-pjrt)")
        path = Path(list(spec.submodule_search_locations)[0]) / package.split(".")[1] / library
        where = f"the installed xla-cpu-pjrt wheel ({path})"
    if not path.is_file():
        raise PluginError(f"PJRT plugin {path} (from {where}): no such file")
    return path


class _CapiClient:
    """A client of a PJRT plugin through its C API, its devices (a CPU plugin makes `count`),
    and compiling for them (`partitions` > 1: one SPMD program over the first that many)."""

    def __init__(self, plugin: str | os.PathLike | None, count: int = 1, partitions: int = 1):
        try:
            import pypjrt
        except ImportError:
            raise PluginError("the C API runtime needs pypjrt (pip install "
                              "'triton-tlaloc[capi]')") from None
        self.pypjrt = pypjrt
        self.plugin_file = plugin_path(plugin)
        # XLA's CPU plugin makes as many devices as this client option asks (measured with
        # xla-cpu-pjrt 0.0.1); asked only for more than one, so a one-device client of any
        # plugin is made as the plugin makes it
        options = {"cpu_device_count": count} if count > 1 else {}
        try:
            self.client = pypjrt.Client.create(plugin=str(self.plugin_file), options=options)
        except Exception as e:
            raise PluginError(f"PJRT plugin {self.plugin_file}: not loaded: {e}") from None
        p = self.client._plugin
        self.api_version = tuple(p.api_version[:2])
        if self.api_version < OLDEST_API:
            raise PluginError(f"PJRT plugin {self.plugin_file}: its C API is "
                              f"{self.api_version[0]}.{self.api_version[1]}, older than the "
                              f"{OLDEST_API[0]}.{OLDEST_API[1]} the runtime needs")
        self._device_context = self.client.devices()
        self.all_devices = self._device_context.__enter__()
        self.platform = self.client.platform_name
        self.partitions = partitions

    def pick(self, indices: tuple[int, ...]) -> list:
        missing = [i for i in indices if not 0 <= i < len(self.all_devices)]
        if missing:
            raise PluginError(f"PJRT plugin {self.plugin_file}: devices {list(indices)} asked, "
                              f"it has {len(self.all_devices)}")
        return [self.all_devices[i] for i in indices]

    @property
    def client_identity(self) -> str:
        """What a compile depends on besides the text and the devices: the plugin's library
        (its bytes' digest: two builds never share an executable), platform and API."""
        return (f"capi|{self.platform}|{_file_digest(self.plugin_file)}|api "
                f"{self.api_version[0]}.{self.api_version[1]}")

    def compile(self, text: str):
        options = None
        if self.partitions > 1:  # the programs' shardings are Shardy's (sdy) when lowered so
            options = self.pypjrt.CompileOptions(
                num_partitions=self.partitions, use_spmd_partitioning=True,
                use_shardy_partitioner="sdy." in text)
        try:
            return self.client.compile(text, options=options)
        except Exception as e:  # pypjrt's PjrtError: the plugin's own message
            raise PluginError(f"PJRT plugin {self.plugin_file} ({self.platform}, API "
                              f"{self.api_version[0]}.{self.api_version[1]}) cannot compile "
                              f"the program: {str(e)[:2000]}") from None

    @staticmethod
    def serialize(executable) -> bytes:
        return executable.serialize()

    def deserialize(self, blob: bytes):
        return self.client.deserialize_executable(blob)

    def put_on(self, array: np.ndarray, device):
        import numpy as np

        array = np.ascontiguousarray(array)
        return self.put_bytes(array.reshape(-1).view(np.uint8), dtype_name(array.dtype),
                              array.shape, device)

    def put_bytes(self, data, element: str, shape, device):
        """A buffer on `device` of a StableHLO element type and shape, from host bytes (any
        object with the buffer protocol, C order)."""
        code = BUFFER_TYPES.get(element)
        if code is None:
            raise TypeError(f"the C API runtime holds no {element} values")
        data = memoryview(data).cast("B")
        if data.readonly:  # pypjrt takes a writable buffer (ctypes' from_buffer)
            data = memoryview(bytearray(data))
        assert len(data) == element_bytes(element) * math.prod(shape), (element, shape, len(data))
        return self.client.buffer_from_host(data, code, list(shape), device)


class CapiDevice(OneDevice, _CapiClient):
    """One device of a PJRT plugin, reached through its C API: what the runtime asks of a
    device (pjrt.PjrtDevice's methods), with no JAX."""

    def __init__(self, plugin: str | os.PathLike | None = None, device_index: int = 0):
        _CapiClient.__init__(self, plugin, device_index + 1)
        self.device, = self.pick((device_index,))
        log.info("PJRT C API: plugin %s (%s, API %d.%d), device %d of %d", self.plugin_file,
                 self.platform, *self.api_version, device_index, len(self.all_devices))

    @property
    def cache_identity(self) -> str:
        index = self.device.id
        return f"{self.client_identity}" + (f"|device {index}" if index else "")

    @property
    def devices(self) -> tuple:
        return (self.device,)

    def put(self, array: np.ndarray):
        return self.put_on(array, self.device)

    def zeros(self, specs: list[tuple[tuple[int, ...], np.dtype]]) -> list:
        """Zeroed buffers, each put from zeroed host bytes."""
        return [self.put_bytes(bytearray(math.prod(shape) * dtype.itemsize), dtype_name(dtype),
                               shape, self.device) for shape, dtype in specs]

    @staticmethod
    def execute(executable, args: list) -> list:
        return executable(*args)

    @staticmethod
    def host(value, axis: int | None = None, dtype=None) -> np.ndarray:
        """A host copy of a value, as a numpy array of its type and shape."""
        import numpy as np

        out = np.empty(tuple(value.dimensions), _numpy_dtype(value.element_type)
                       if dtype is None else dtype)
        value.to_host(memoryview(out.reshape(-1).view(np.uint8)))
        return out

    @staticmethod
    def addresses(value) -> tuple[int, ...]:
        return (value.unsafe_pointer(),)

    @staticmethod
    def wait(buffer) -> None:
        """(An execution has ended when it returns: pypjrt awaits its completion events.)"""

    def read(self, buffer) -> np.ndarray:
        return self.host(buffer)


class CapiMesh(ManyDevices, _CapiClient):
    """The N devices of one tensor-parallel instance of a PJRT plugin, through its C API:
    programs compiled with N partitions (XLA's SPMD partitioner), every value a tuple of N
    per-device buffers, as pjrt.PjrtMesh holds them."""

    def __init__(self, plugin: str | os.PathLike | None, device_indices: tuple[int, ...]):
        n = len(device_indices)
        if tuple(device_indices) != tuple(range(n)):
            raise PluginError(f"devices {list(device_indices)}: the C API runtime runs an "
                              f"artifact for {n} devices on the plugin's first {n}")
        _CapiClient.__init__(self, plugin, n, partitions=n)
        self.devices = tuple(self.pick(tuple(device_indices)))
        log.info("PJRT C API: plugin %s (%s, API %d.%d), devices 0..%d", self.plugin_file,
                 self.platform, *self.api_version, n - 1)

    @property
    def cache_identity(self) -> str:
        return f"{self.client_identity}|devices {','.join(str(d.id) for d in self.devices)}"

    def put(self, array: np.ndarray) -> tuple:
        """A copy of `array` on every device (a replicated input)."""
        return tuple(self.put_on(array, d) for d in self.devices)

    def put_shards(self, shards: list[np.ndarray]) -> tuple:
        assert len(shards) == self.size, (len(shards), self.size)
        return tuple(self.put_on(a, d) for a, d in zip(shards, self.devices))

    def zeros(self, specs: list[tuple[tuple[int, ...], np.dtype]]) -> list[tuple]:
        """Zeroed values of the shard shapes `specs`, one on each device."""
        return [tuple(self.put_bytes(bytearray(math.prod(shape) * dtype.itemsize),
                                     dtype_name(dtype), shape, d) for d in self.devices)
                for shape, dtype in specs]

    def execute(self, executable, args: list[tuple]) -> list[tuple]:
        per_device = executable.execute_sharded([[a[d] for a in args]
                                                 for d in range(self.size)])
        return [tuple(outs) for outs in zip(*per_device)]

    @staticmethod
    def host(value: tuple, axis: int | None) -> np.ndarray:
        import numpy as np

        if axis is None:
            return CapiDevice.host(value[0])
        return np.concatenate([CapiDevice.host(b) for b in value], axis=axis)

    @staticmethod
    def addresses(value: tuple) -> tuple[int, ...]:
        return tuple(b.unsafe_pointer() for b in value)

    @staticmethod
    def wait(buffer) -> None:
        """(An execution has ended when it returns.)"""

    @staticmethod
    def read(buffer) -> np.ndarray:
        return CapiDevice.host(buffer)


def element_name(code: int) -> str:
    """The StableHLO element type name of a PJRT buffer type."""
    name = next((n for n, c in BUFFER_TYPES.items() if c == code), None)
    if name is None:
        raise TypeError(f"PJRT buffer type {code}: the C API runtime reads no such values")
    return name


def _numpy_dtype(code: int) -> np.dtype:
    return numpy_dtype(element_name(code))


_DIGESTS: dict[Path, str] = {}


def _file_digest(path: Path) -> str:
    """The sha256 of a plugin's bytes (read once a process)."""
    if path not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _DIGESTS[path] = h.hexdigest()[:16]
    return _DIGESTS[path]


__all__ = ["CapiDevice", "CapiMesh", "PLUGIN_ENV", "PluginError", "plugin_path"]
