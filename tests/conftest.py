import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Compiling the tests' tiny programs is most of the suite's time. XLA's CPU compiler builds them ~2x faster with LLVM
# unoptimised and ~1.6x faster again with its classic fusion emitters rather than the MLIR ones (numerics unchanged in
# kind). Compute-heavy runs ask for optimised code: compiler_options={"xla_backend_optimization_level": 2} (the
# training run of test_parallel_consistency). The flags pass by the environment to the workers and to the commands
# the tests start (an XLA_FLAGS given to the run is used as it is).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _known_to_xla(flag: str) -> bool:
    """XLA aborts a process on an unknown flag: ask a child process whether this jaxlib knows `flag`."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                          timeout=120).returncode == 0


if "XLA_FLAGS" not in os.environ:
    _flags = ["--xla_force_host_platform_device_count=4", "--xla_backend_optimization_level=0"]
    if _known_to_xla(_LEGACY_EMITTERS):
        _flags.append(_LEGACY_EMITTERS)
    os.environ["XLA_FLAGS"] = " ".join(_flags)

# One persistent compilation cache per test run, made by the first process (pytest-xdist's controller) and passed by
# the environment to its workers and to the commands the tests start: compiling dominates the suite, and the same tiny
# programs recur across modules (each module drops its programs, see below), workers and commands, where loading one
# costs a fraction of compiling it. Entries are keyed on the program, the compiler options and the JAX version.
_OWN_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE_DIR:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="pjax-test-compilation-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tests' programs compile in under a second
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)  # a size limit turns on the lock the processes share

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Ctrl-C tests send SIGINT to the test process and to the commands it starts. A suite started in the background of a
# shell inherits SIGINT ignored, and ignored signals stay ignored across exec: restore the interrupt handler.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=os.environ.get("PJAX_FULL_TESTS") == "1",
                     help="also run the tests marked `full` (the whole parameter sweeps and the slowest end-to-end "
                          "runs; `bash .ci/run --full`, or PJAX_FULL_TESTS=1)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: a test (or a sweep's case) that runs with --full only: each behaviour it "
                                       "checks is also checked by a cheaper test or case of the default run")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    full = [item for item in items if item.get_closest_marker("full")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("full")]


def pytest_unconfigure(config):
    if _OWN_CACHE_DIR and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure's report as UTF-8-encodable text: a lone surrogate in an assertion message or a captured log line
    (the server tests send them on purpose) would otherwise crash the xdist worker that sends the report."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        rep.longrepr = _utf8(str(rep.longrepr))
    rep.sections = [(name, _utf8(text)) for name, text in rep.sections]
