"""The test suite's own rules (tests/conftest.py), run on a throwaway test file in a child pytest:
fresh random data per run, the run seed printed with a failure and replayed by FP4KIT_SEED, and
FP4KIT_REQUIRE_GPU=1 turning a skipped GPU test into a failure."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parent / "conftest.py"
SAMPLE = '''
import pytest

def test_draw(rng):
    print("DRAW", rng.integers(0, 2**62))
    assert {fail}

@pytest.mark.gpu
def test_needs_gpu():
    pass
'''


def _pytest(tmp_path, *, fail=False, **env):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE.format(fail="False" if fail else "True"))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FP4KIT_")} | env
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)
    draws = re.findall(r"DRAW (\d+)", done.stdout)
    return done, draws


def test_each_run_draws_fresh_data(tmp_path):
    (a, draw_a), (b, draw_b) = _pytest(tmp_path), _pytest(tmp_path)
    assert a.returncode == b.returncode == 0, a.stdout
    assert len(draw_a) == len(draw_b) == 1 and draw_a != draw_b


def test_a_failure_prints_the_seed_that_replays_it(tmp_path):
    failed, first = _pytest(tmp_path, fail=True)
    assert failed.returncode == 1
    seed = re.search(r"replay with FP4KIT_SEED=(\d+)", failed.stdout)
    assert seed, failed.stdout
    replay, again = _pytest(tmp_path, fail=True, FP4KIT_SEED=seed[1])
    assert replay.returncode == 1 and again == first  # the same data


def test_a_bad_seed_is_a_usage_error(tmp_path):
    done, _ = _pytest(tmp_path, FP4KIT_SEED="abc")
    assert done.returncode != 0 and "FP4KIT_SEED: expected an integer, got 'abc'" in done.stdout + done.stderr


def test_require_gpu_turns_a_skipped_gpu_test_into_a_failure(tmp_path):
    plain, _ = _pytest(tmp_path)
    required, _ = _pytest(tmp_path, FP4KIT_REQUIRE_GPU="1")
    if sys.modules["conftest"].HAVE_GPU:  # the GPU test runs: nothing is skipped either way
        assert plain.returncode == required.returncode == 0 and "2 passed" in required.stdout
        return
    assert plain.returncode == 0 and "1 passed, 1 skipped" in plain.stdout
    assert required.returncode == 1
    assert "FP4KIT_REQUIRE_GPU=1, but this GPU test was skipped" in required.stdout
