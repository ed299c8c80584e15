"""Test setup: 8 simulated CPU devices and strict numpy semantics, before jax is imported."""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

# The tests compile far more than they compute: LLVM's optimisations (level 0) take about half
# of XLA's CPU compile time and buy little on tiny models. HLO optimisation, and so every
# program's ops, fusions and memory plan, is unchanged.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def _xla_flags(devices: int, optimize: bool = False) -> str:
    flags = f"--xla_force_host_platform_device_count={devices}"
    return flags if optimize else f"{flags} {TEST_XLA_FLAGS}"


os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_xla_flags(8)}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the whole run, shared by the `jaxllm` processes that tests start
# (they inherit the environment; the pytest processes keep none, below): the many small runs of
# the same tiny configs compile their steps once. Compiles under half a second are not worth an entry.
# The process that made the directory removes it at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxllm-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# A size bound turns on jax's file lock around every cache read and write: without it an entry
# is written in place, and a process reading it while another is still writing it loads a torn
# executable (a pytest worker died of a segmentation fault in the cache read that way).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import re  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# The pytest processes themselves keep no persistent cache (the `jaxllm` processes they start
# still share it): twice in one suite a worker died of a segmentation fault inside jaxlib's
# (de)serialization of an in-process train step's executable (`executable.serialize()` on a
# write, `deserialize_executable` on a read), killing every test left on that worker.
jax.config.update("jax_enable_compilation_cache", False)

from objectstore import s3, s3_env  # noqa: E402, F401  (the moto server fixtures)

# `--dist loadscope` that survives a crashed worker (pytest-xdist 3.8's own can hang the run).
pytest_plugins = ["xdist_crash_safe"]

from trained_runs import SHARED_RUNS, changed, trained_run  # noqa: E402

from jaxllm.config import Config, ModelConfig  # noqa: E402

# Files that import torch / transformers at the top (their reference models) and tests marked
# `torch`: the Python 3.11 line runs them; `--without-torch` leaves them out where no CPU torch
# build exists (the newest-jax line, `make test-newest`). Without the option a missing torch is an
# import error, never a silent skip.
_TORCH_IMPORT = re.compile(r"^(import torch|import transformers|from hf_models import)", re.M)


# Every executable XLA keeps alive holds about nine memory mappings (its JIT-compiled code and
# data), and a worker that runs half the suite compiles tens of thousands of programs: past the
# kernel's vm.max_map_count (65,530 by default) the next compile's mmap fails and the worker dies
# of a segmentation fault (in a compile, or in the compilation cache's serialization). After each
# test module, a worker holding more than a third of that limit drops jax's caches.
def _map_limit() -> int:
    try:
        return int(open("/proc/sys/vm/max_map_count").read()) // 3
    except (OSError, ValueError):
        return 0


MAP_LIMIT = _map_limit()


def memory_maps() -> int:
    """How many memory mappings this process holds (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_executables():
    yield
    if MAP_LIMIT and memory_maps() > MAP_LIMIT:
        jax.clear_caches()
        gc.collect()


def _controller(config) -> bool:
    """Whether this is the session's controller (or its only process, -n 0), not an xdist worker."""
    return not hasattr(config, "workerinput")


# The runs trained_runs.py shares between the workers: one directory for the session, made by
# the controller before it starts the workers (they inherit the environment) and removed after.
def pytest_configure(config):
    if _controller(config):
        os.environ[SHARED_RUNS] = tempfile.mkdtemp(prefix="jaxllm-test-runs-")


def pytest_sessionfinish(session):
    if _controller(session.config) and (bad := changed()):
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", f"shared runs changed by a test (copy first): {bad}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config):
    if _controller(config) and SHARED_RUNS in os.environ:
        shutil.rmtree(os.environ.pop(SHARED_RUNS), ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption(
        "--without-torch",
        action="store_true",
        help="leave out the tests that need torch + transformers (reference models)",
    )


_TEST_IMPORT = re.compile(r"^from (?:tests\.)?(test_\w+|hf_\w+) import", re.M)
_TORCH_LIBS = re.compile(r"^(?:from|import) (?:torch|transformers|trl|peft)\b", re.M)


def _needs_torch(path, seen=()) -> bool:
    """Whether a test module imports torch, itself or through the test modules it imports."""
    text = path.read_text()
    if _TORCH_IMPORT.search(text) or _TORCH_LIBS.search(text):
        return True
    for name in _TEST_IMPORT.findall(text):
        dep = path.with_name(name + ".py")
        if dep.exists() and dep not in seen and _needs_torch(dep, (*seen, path)):
            return True
    return False


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--without-torch") and collection_path.suffix == ".py":
        return _needs_torch(collection_path) or None
    return None


# Tests marked `slow` by their measured time rather than by a decorator: node ids, one a line,
# chosen from a whole run's durations so the default run keeps its time budget and the cheapest
# case of each parametrized test (`make test-all` runs them all).
SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def _listed_slow() -> set[str]:
    with open(SLOW_LIST) as f:
        return {ln.strip() for ln in f if ln.strip() and not ln.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    listed = _listed_slow()
    files = {item.nodeid.split("::")[0] for item in items}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    stale = sorted(n for n in listed - {i.nodeid for i in items} if n.split("::")[0] in files)
    whole_files = not any("::" in a for a in config.args)
    if (
        stale
        and whole_files
        and not config.getoption("keyword")
        and not config.getoption("lf", False)
    ):
        raise pytest.UsageError(f"tests/slow_tests.txt names tests that do not exist: {stale[:5]}")
    if not config.getoption("--without-torch"):
        return
    left_out = [item for item in items if item.get_closest_marker("torch") is not None]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.get_closest_marker("torch") is None]


# The `jaxllm` processes the tests start (not this one) compile with XLA's classic CPU emitter:
# the MLIR fusion emitters take about half of a small program's compile (a 2-step SMALL_RUN
# train: 10.3 s of CPU against 6.0 s, imports included). Not in this process: its last bits
# (tanh) move the shared 300-step quantization run, and test_qat's QAT-below-RTN comparison sits
# within them. jaxlib 0.12 (the newest line) has no such flag and an unknown XLA flag aborts, so
# a child process asks once; the answer is kept in the environment for the workers.
CLASSIC_EMITTER = "--xla_cpu_use_fusion_emitters=false"


def _classic_emitter() -> str:
    if "JAXLLM_TEST_CLASSIC_EMITTER" not in os.environ:
        probe = "from jaxlib import xla_client; xla_client.make_cpu_client()"
        env = {**os.environ, "XLA_FLAGS": CLASSIC_EMITTER, "JAX_PLATFORMS": "cpu"}
        known = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
        os.environ["JAXLLM_TEST_CLASSIC_EMITTER"] = CLASSIC_EMITTER if known.returncode == 0 else ""
    return os.environ["JAXLLM_TEST_CLASSIC_EMITTER"]


def cpu_env(
    devices: int = 1, *, optimize: bool = False, as_this_process: bool = False, **extra
) -> dict:
    """The environment of a `jaxllm` process a test starts: the CPU with `devices` simulated
    devices and the tests' XLA flags with the classic emitter (`optimize`: XLA's defaults, for
    runs that compute more than they compile; `as_this_process`: this process's flags, for runs
    compared bit for bit with its own), plus `extra`."""
    flags = _xla_flags(devices, optimize)
    if not (optimize or as_this_process):
        flags = f"{flags} {_classic_emitter()}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **extra}


def abstract_state(*overrides: str):
    """The config of `overrides` on this process's devices, as `jaxllm plan` bills it: (abstract
    TrainState, its shardings, the parameters' logical axes, the gradients' shardings)."""
    from jaxllm import config, optim, sharding
    from jaxllm.model import abstract_model
    from jaxllm.train.state import grad_shardings, init_state, layout, state_shardings

    cfg = config.load(None, list(overrides))
    mesh = sharding.make_mesh(cfg.mesh, jax.devices())
    _, _, axes = abstract_model(cfg.model)
    tx = optim.build(cfg.optim, 10, axes)
    shardings = state_shardings(cfg.model, tx, mesh, **layout(cfg))
    state = jax.eval_shape(lambda: init_state(cfg.model, tx, mesh, 0))
    return state, shardings, axes, grad_shardings(cfg.model, mesh, cfg.mesh.zero_stage)


def tiny_model(**overrides) -> ModelConfig:
    """A model small enough for many compiles per test, in float32 for tight comparisons."""
    base = dict(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=64,
        max_seq_len=64,
        dtype="float32",
        param_dtype="float32",
    )
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return tiny_model()


@pytest.fixture
def default_config() -> Config:
    return Config()


def shard_model(model, mesh):
    """`model` with its parameters laid out on `mesh` by their logical axes."""
    from flax import nnx

    from jaxllm import sharding
    from jaxllm.model import abstract_model

    graphdef, _, axes = abstract_model(model.cfg)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return nnx.merge(graphdef, jax.device_put(params, sharding.tree_shardings(mesh, axes)))


# A small model on the built-in corpus, for runs the tests train through `jaxllm.cli.main`.
# A one-block model of width 32 the distillation tests train teachers and students from
# (their own data and depth added).
TINY_RUN = [
    "data.seq_len=32",
    "model.num_layers=1",
    "model.d_model=32",
    "model.mlp_dim=64",
    "model.vocab_size=320",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "optim.warmup_steps=0",
    "optim.lr=1e-2",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


SMALL_RUN = [
    "data.max_files=60",
    "data.seq_len=64",
    "model.num_layers=2",
    "model.d_model=64",
    "model.mlp_dim=128",
    "model.vocab_size=320",
    "model.dtype=float32",
    "train.global_batch_size=8",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "mesh.data=1",
    "mesh.fsdp=-1",
]


def train_for_quantization():
    """SMALL_RUN trained 300 steps at a high learning rate: enough that quantizing its layers
    shows in the loss (the quantization tests' float run). Shared by the session: read it, never
    change it."""
    argv = [*SMALL_RUN, "train.steps=300", "checkpoint.every=300", "optim.lr=1e-2"]
    return trained_run("quantize", [*argv, "train.log_every=100", "train.eval_batches=4"])


@pytest.fixture(scope="session")
def small_run():
    """A run of SMALL_RUN trained 4 steps with checkpoints at 2 and 4. Shared by the session
    (both workers): copy it before changing anything in it."""
    return trained_run("small", [*SMALL_RUN, "train.steps=4", "checkpoint.every=2"])


@pytest.fixture(scope="session")
def small_lora(small_run):
    """A LoRA fine-tune of `small_run` on another data order: 3 steps at a high learning rate
    (3e-2, no warmup) so that its B is far from zero, checkpointed at 3 (test_merge's and
    test_named_adapters'). Shared by the session: copy it first."""
    lora = ["peft.method=lora", f"checkpoint.init_from={small_run}", "data.seed=1"]
    tune = ["train.steps=3", "checkpoint.every=3", "optim.lr=3e-2", "optim.warmup_steps=0"]
    return trained_run("small-lora", [*SMALL_RUN, *tune, *lora])


@pytest.fixture(scope="session")
def small_moe():
    """SMALL_RUN with four routed experts and a shared one, trained 1 step (test_quantized_uses'
    and test_quantize's MoE run). Shared by the session: copy it first."""
    moe = ["model.moe.num_experts=4", "model.moe.num_shared_experts=1"]
    return trained_run("small-moe", [*SMALL_RUN, *moe, "train.steps=1"])
