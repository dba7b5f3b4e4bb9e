"""Running an artifact on devices: PJRT, compiling and its cache, the runtime, page transfers."""
