import gc
import os
import shutil
import signal
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# One persistent compilation cache per test run, made by the first process (pytest-xdist's controller) and shared by
# its workers through the environment: compiling dominates the suite, and the same tiny programs recur across modules
# (each module drops its programs, see below) and across workers, where loading one costs a fraction of compiling it.
# Entries are keyed on the program, the compiler options and the JAX version, so a hit is the same executable.
_CACHE_DIR_VAR = "PJAX_TEST_COMPILATION_CACHE"
_OWN_CACHE_DIR = _CACHE_DIR_VAR not in os.environ
if _OWN_CACHE_DIR:
    os.environ[_CACHE_DIR_VAR] = tempfile.mkdtemp(prefix="pjax-test-compilation-cache-")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_DIR_VAR])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the tests' programs compile in under a second
jax.config.update("jax_compilation_cache_max_size", 8 << 30)  # a size limit turns on the lock the workers share

# Ctrl-C tests send SIGINT to the test process and to the commands it starts. A suite started in the background of a
# shell inherits SIGINT ignored, and ignored signals stay ignored across exec: restore the interrupt handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


import pytest  # noqa: E402


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ[_CACHE_DIR_VAR], ignore_errors=True)


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
