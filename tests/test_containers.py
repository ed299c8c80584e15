"""The container images install what `make train` and `make test` install.

docker cannot build in CI, so these tests read the files: the pip install lines of the Makefile's
`make train` and `make test` and of each Dockerfile must install the project with the same
extras in the same order (the CUDA image adds jax's CUDA extra, the one the README names), the
base images are pinned by a tag, the images run `jaxllm train` by default, and the build context
leaves out the virtualenv, runs and caches.
"""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = {"cpu": ROOT / "Dockerfile.cpu", "cuda": ROOT / "Dockerfile"}


def _commands(text: str) -> list[list[str]]:
    """Shell commands of the lines of a Makefile or Dockerfile that run pip, as word lists:
    continuation lines joined, comments dropped, commands split at `&&` and `;`."""
    commands = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        if "pip" not in line or line.lstrip().startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.commenters = "#"
        words = []
        for token in [*lexer, ";"]:
            if token in ("&&", ";", "||", "&", "|"):
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def pip_installs(text: str) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each `pip install` of the project: (its extras, the other requirements on that line).
    `pip install --upgrade pip` is not an install of the project and is left out."""
    out = []
    for words in _commands(text):
        if "pip" not in words or "install" not in words[words.index("pip") :]:
            continue
        args = words[words.index("install", words.index("pip")) + 1 :]
        specs = [a for a in args if not a.startswith("-")]
        project = [s for s in specs if s == "." or s.startswith(".[")]
        if not project:
            assert specs == ["pip"], f"a pip install of neither the project nor pip: {words}"
            continue
        (spec,) = project
        extras = tuple(re.findall(r"[\w-]+", spec[2:-1])) if spec.startswith(".[") else ()
        assert "-e" in args, f"the project installed without -e (as the Makefile): {words}"
        out.append((extras, tuple(s for s in specs if s != spec)))
    return out


def makefile_recipe(target: str) -> str:
    """The recipe lines of a Makefile rule, found by its target as written (`$(CORE)`)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line)
    return "\n".join(recipe)


def makefile_installs() -> list[tuple[str, ...]]:
    """The installs of `make train` (its prerequisite $(CORE)) and `make test` ($(TESTS))."""
    installs = pip_installs(makefile_recipe("$(CORE)") + "\n" + makefile_recipe("$(TESTS)"))
    assert all(not other for _, other in installs), installs
    return [extras for extras, _ in installs]


def test_makefile_installs_train_then_test_extras():
    # `make train` installs the project alone, `make test` the test extra.
    assert re.search(r"^train: \$\(CORE\)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert re.search(r"^test: \$\(TESTS\)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert makefile_installs() == [(), ("test",)]


def _readme_jax_cuda_extra() -> str:
    found = set(re.findall(r"jax\[(cuda\d+)\]", (ROOT / "README.md").read_text()))
    assert len(found) == 1, f"the README names one jax CUDA extra, found {sorted(found)}"
    return found.pop()


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_dockerfile_installs_what_the_makefile_installs(kind):
    installs = pip_installs(DOCKERFILES[kind].read_text())
    assert [extras for extras, _ in installs] == makefile_installs()
    others = [o for _, other in installs for o in other]
    if kind == "cpu":
        assert others == []
    else:
        assert others == [f"jax[{_readme_jax_cuda_extra()}]"]


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_dockerfile_base_pinned_and_runs_train(kind):
    text = DOCKERFILES[kind].read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    name, _, tag = base.partition(":")
    assert tag and tag != "latest", (
        f"{DOCKERFILES[kind].name}: base image {base} not pinned by a tag"
    )
    if kind == "cpu":
        assert name == "python" and tag.startswith("3.11"), base
    else:
        assert name == "nvidia/cuda", base
        cuda_major = re.match(r"(\d+)\.", tag).group(1)
        assert _readme_jax_cuda_extra() == f"cuda{cuda_major}", "base image and jax extra differ"
    copied = {
        w for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.M) for w in line.split()[:-1]
    }
    assert {"pyproject.toml", "README.md", "jaxllm", "kernels"} <= copied
    assert re.findall(r"^CMD\s+(.+)$", text, flags=re.M) == ['["jaxllm", "train"]']


def test_dockerignore_leaves_out_venv_runs_and_caches():
    lines = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", "runs", "**/__pycache__", ".pytest_cache", ".git"} <= lines


def test_pip_install_parser():
    text = (
        "RUN python -m pip install --quiet --upgrade pip \\\n"
        " && python -m pip install -e . \\\n"
        " && python -m pip install -e '.[test, docs]' 'jax[cuda13]'  # a comment\n"
        "\t$(BIN)/python -m pip install --quiet -e .\n"
    )
    assert pip_installs(text) == [((), ()), (("test", "docs"), ("jax[cuda13]",)), ((), ())]
