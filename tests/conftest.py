import gc
import os
import signal

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Ctrl-C tests send SIGINT to the test process and to the commands it starts. A suite started in the background of a
# shell inherits SIGINT ignored, and ignored signals stay ignored across exec: restore the interrupt handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each test module ends by dropping its compiled programs. A process keeps about 11 memory mappings per XLA
    executable, and the whole suite compiles enough programs to pass Linux's 65,530-mapping limit, after which a
    later compilation crashes (a segmentation fault in XLA)."""
    yield
    from pjax.decode.compiled import clear_compiled
    clear_compiled()
    jax.clear_caches()
    gc.collect()
