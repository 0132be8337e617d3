"""The status-word flags: one list for the kernels (raw_kernels/common/status.cuh), one for Python
(fp4kit.runtime.status), and they agree."""

import re

from fp4kit.runtime import loader, status

HEADER = loader.KERNEL_DIR / "common" / "status.cuh"


def header_flags() -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^#define FP4_STATUS_(\w+) (\d+)u\b", HEADER.read_text(), re.M)}


def test_header_and_python_name_the_same_flags():
    flags = header_flags()
    assert flags == {name: getattr(status, name) for name in flags}
    assert set(flags.values()) == set(status.FLAG_NAMES)
    assert all(v and not v & (v - 1) for v in flags.values()) and len(set(flags.values())) == len(flags)  # distinct bits


def test_no_kernel_defines_its_own_flag():
    # every kernel uses the shared header; no other status define, no literal or-ed into status
    for path in [*loader.KERNEL_DIR.glob("*.cu"), *loader.KERNEL_DIR.glob("common/*.cuh")]:
        if path == HEADER:
            continue
        text = path.read_text()
        assert not re.search(r"^#define \w*STATUS\w*", text, re.M), path.name
        assert not re.search(r"atomicOr\(status, \d", text), path.name
        if "atomicOr(status" in text:
            assert "FP4_STATUS_" in text and "status.cuh" in loader.kernel_source(path.stem), path.name
