"""The README's code runs as written: every ```python snippet executes on the numpy backend here
(each in a fresh namespace: a snippet defines everything it uses), the ones marked
``<!-- readme-test: gpu -->`` run in the GPU suite, and every command of a ```bash block matches
the install the README gives (the venv's interpreter and scripts, not a bare ``python``)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
GPU_MARK = "<!-- readme-test: gpu -->"


def _blocks(language: str) -> list[tuple[int, str, bool]]:
    """``(line number, code, gpu-only)`` of every fenced block of ``language``."""
    lines = README.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{language}":
            start = i + 1
            end = lines.index("```", start)
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            blocks.append((start + 1, "\n".join(lines[start:end]), before == GPU_MARK))
            i = end
        i += 1
    return blocks


PYTHON = _blocks("python")
CPU_SNIPPETS = [(line, code) for line, code, gpu in PYTHON if not gpu]
GPU_SNIPPETS = [(line, code) for line, code, gpu in PYTHON if gpu]


def test_the_readme_has_its_snippets():
    # a change to the fence or marker syntax must not silently drop snippets from the tests
    assert len(CPU_SNIPPETS) >= 7 and len(GPU_SNIPPETS) >= 1
    assert README.read_text().count("```python") == len(PYTHON)
    assert README.read_text().count(GPU_MARK) == len(GPU_SNIPPETS)


def _run(code: str, line: int, monkeypatch, tmp_path) -> None:
    from fp4kit.runtime import status

    for key in ("FP4KIT_WORLD_SIZE", "FP4KIT_RANK", "FP4KIT_RENDEZVOUS"):  # dist.init(): world size 1
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    status.clear()  # host and device words: a snippet may check them
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("line, code", CPU_SNIPPETS, ids=[f"line{line}" for line, _ in CPU_SNIPPETS])
def test_snippet_runs_on_numpy(line, code, monkeypatch, tmp_path):
    needs_gpu = re.search(r"^\s*(import|from)\s+(cupy|torch)\b", code, re.M)
    assert not needs_gpu, f"README.md:{line}: a snippet that imports {needs_gpu[2]} must carry the gpu marker"
    _run(code, line, monkeypatch, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("line, code", GPU_SNIPPETS, ids=[f"line{line}" for line, _ in GPU_SNIPPETS])
def test_gpu_snippet_runs(line, code, monkeypatch, tmp_path):
    _run(code, line, monkeypatch, tmp_path)


def _commands():
    for line, code, _ in _blocks("bash"):
        for offset, text in enumerate(code.split("\n")):
            text = text.split(" #")[0].strip()
            if text and not text.startswith("#"):
                for part in text.split("&&"):
                    yield line + offset, part.strip()


def test_commands_use_the_installed_venv():
    commands = list(_commands())
    assert len(commands) > 20
    for line, cmd in commands:
        if cmd.startswith("python3 -m venv .venv"):
            continue  # creates the venv everything else runs from
        first = re.split(r"\s+", cmd)[0]
        assert not first.startswith("PYTHONPATH="), f"README.md:{line}: the editable install needs no PYTHONPATH: {cmd}"
        assert first not in ("python", "python3", "pip", "fp4kit", "pytest"), (
            f"README.md:{line}: {first!r} is not on PATH after the README's install; use .venv/bin/{first}: {cmd}")
        if first.startswith(".venv/bin/"):
            assert first[len(".venv/bin/"):] in ("python", "pip", "fp4kit"), f"README.md:{line}: {cmd}"


def test_first_two_commands_are_the_install_and_the_tests():
    # what CI (.ci/run) and a new user run first
    first = _blocks("bash")[0][1].split("\n")
    assert first[1] == 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[cuda13]" && .venv/bin/python examples/decode.py'
    assert first[3] == 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[cuda13,test]" && .venv/bin/python -m pytest -q'
