"""torchfile: torch's own file format written without torch, read back by torch itself."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from tokenbridge.export import torchfile


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "long": rng.integers(-(1 << 62), 1 << 62, size=300, dtype=np.int64),
        "bool": rng.random(1000) < 0.3,
        "int32": rng.integers(-(1 << 31), 1 << 31, size=(3, 5), dtype=np.int32),
        "uint8": rng.integers(0, 256, size=17, dtype=np.uint8),
        "float32": rng.standard_normal((2, 3, 4)).astype(np.float32),
        "float64": rng.standard_normal(9),
        "empty": np.zeros(0, dtype=np.int64),
        "scalar": np.array(5, dtype=np.int64),
        "transposed": np.arange(12, dtype=np.int64).reshape(3, 4).T,
    }


def test_tensors_load_with_exact_dtypes_shapes_and_values(torch, tmp_path):
    arrays = _arrays()
    torchfile.save(arrays, tmp_path / "ours.pt")
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert list(got) == list(arrays)
    for name, arr in arrays.items():
        want = torch.from_numpy(np.ascontiguousarray(arr))
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name


def test_memory_mapped_load_sees_aligned_storages(torch, tmp_path):
    arrays = _arrays()
    torchfile.save(arrays, tmp_path / "ours.pt")
    got = torch.load(tmp_path / "ours.pt", weights_only=True, mmap=True)
    assert all(torch.equal(got[k], torch.from_numpy(np.ascontiguousarray(v))) for k, v in arrays.items())


def test_int_dict_equals_what_torch_save_writes(torch, tmp_path):
    counts = {0: 1, 7: 255, 300: 256, 70_000: 65_536, 163_839: (1 << 31) - 1, 5: 1 << 31, 6: 1 << 62, 8: -3}
    torchfile.save(counts, tmp_path / "ours.pt")
    torch.save(counts, tmp_path / "theirs.pt")
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert ours == torch.load(tmp_path / "theirs.pt", weights_only=True) == counts
    assert list(ours) == list(counts)


def test_unsupported_values_are_refused(tmp_path):
    with pytest.raises(TypeError, match="complex128"):
        torchfile.save({"x": np.zeros(2, dtype=np.complex128)}, tmp_path / "x.pt")
    with pytest.raises(TypeError, match="float"):
        torchfile.save({"x": 1.5}, tmp_path / "y.pt")


_NO_TORCH = """
import sys
sys.modules["torch"] = None  # import torch raises ImportError
sys.modules["datasets"] = None
from tokenbridge.cli import main
sys.argv = ["tokenbridge"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("fmt", ["speculators", "vocab"])
def test_exports_need_neither_torch_nor_datasets(tmp_path, kimi, kimi_dir, fmt, torch):
    """A plain install has no torch: the speculators folder and vocab_mapping.pt are still written,
    and torch (here, where it is installed) reads them."""
    from test_export_support import make_run, write_jsonl

    src = write_jsonl(tmp_path / "reconstructed.jsonl", make_run(kimi, 12)[1])
    out = tmp_path / "out"
    if fmt == "vocab":
        args = ["vocab", str(src), "--draft-vocab-size", "64", "-o", str(out), "--tokenizer", str(kimi_dir)]
    else:
        args = ["export", str(src), "-o", str(out), "--format", fmt]
    env_path = f"{ROOT / 'src'}:{ROOT / 'tests'}"
    res = subprocess.run([sys.executable, "-c", _NO_TORCH, *args], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stdout + res.stderr
    if fmt == "vocab":
        mapping = torch.load(out / "vocab_mapping.pt", weights_only=True)
        assert mapping["d2t"].tolist() == np.load(out / "d2t.npy").tolist()
        assert mapping["t2d"].dtype == torch.bool and int(mapping["t2d"].sum()) == 64
    else:
        from datasets import load_from_disk

        ds = load_from_disk(str(out))
        assert ds.format["type"] == "torch" and ds[0]["input_ids"].dtype == torch.int64

