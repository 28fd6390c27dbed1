"""What ``--model`` may name (gpu_worker/model_source.py) and the dtype setting
(gpu_worker/dtype.py): without loading a real checkpoint (tests/e2e/test_real_model.py
loads the registry one)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gpu_worker import dtype as dtypes
from gpu_worker.model_source import REGISTRY, convert_gguf, locate_model, resolve_model


def write_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_locate_names_every_kind(tmp_path: Path, model: Path) -> None:
    assert locate_model("") == ("tiny", "")
    assert locate_model("smollm2-135m-instruct") == ("registry", "smollm2-135m-instruct")
    assert locate_model(str(model)) == ("dir", str(model))
    one = tmp_path / "one"
    one.mkdir()
    file = write_gguf(one / "m.gguf", "llama")
    assert locate_model(str(file)) == ("gguf", str(file))
    assert locate_model(str(one)) == ("gguf", str(file))  # a directory holding one
    write_gguf(one / "other.gguf", "llama")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(m.gguf, other.gguf\); name one"):
        locate_model(str(one))
    with pytest.raises(ValueError, match=r"no config.json.*smollm2-135m-instruct"):
        locate_model(str(tmp_path / "missing"))
    assert resolve_model(str(model)) == model


def test_unsupported_gguf_architecture_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXPEDITOR_CACHE_DIR", str(tmp_path / "cache"))
    file = write_gguf(tmp_path / "odd.gguf", "rwkv7")
    with pytest.raises(ValueError, match="architecture 'rwkv7', which transformers cannot read"):
        convert_gguf(file)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"junk\.gguf is not a readable GGUF file"):
        convert_gguf(tmp_path / "junk.gguf")
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []


def test_registry_entries_name_a_gguf() -> None:
    for entry in REGISTRY.values():
        assert entry.file.endswith(".gguf") and entry.version


def test_dtype_setting() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert dtypes.resolve_dtype("bfloat16", cpu) == (torch.bfloat16, "dtype=bfloat16")
    assert dtypes.resolve_dtype("auto", cuda) == (torch.bfloat16, "auto: CUDA")
    off = dtypes.resolve_dtype("auto", cpu, {"EXPEDITOR_CPU_BF16": "0"})
    assert off == (torch.float32, "auto: EXPEDITOR_CPU_BF16=0")
    chosen, why = dtypes.resolve_dtype("auto", cpu, {})
    if dtypes.cpu_bf16_features():  # this CPU has bf16 arithmetic
        assert chosen == torch.bfloat16 and ("avx512_bf16" in why or "amx_bf16" in why)
    else:
        assert chosen == torch.float32 and "no bfloat16" in why
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        dtypes.resolve_dtype("int8", cpu)


def test_cpu_features_read_the_flags_line(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = Path("/proc/cpuinfo")
    if not flags.exists():
        pytest.skip("no /proc/cpuinfo")
    line = next(x for x in flags.read_text().splitlines() if x.startswith("flags"))
    expected = tuple(f for f in dtypes.BF16_FLAGS if f in line.split(":", 1)[1].split())
    assert dtypes.cpu_bf16_features() == expected


def test_a_bf16_cpu_worker_holds_twice_the_blocks_in_the_same_memory(model: Path) -> None:
    from gpu_worker.model_runner import DEFAULT_CPU_BLOCKS, ModelRunner
    from shared.worker_settings import WorkerSettings

    sizes = {}
    for name in ("float32", "bfloat16"):
        settings = WorkerSettings.of(model=str(model), dtype=name)
        runner = ModelRunner(settings, device=torch.device("cpu"))
        assert runner.dtype == dtypes.DTYPES[name] and runner.kv_cache.layout.dtype == runner.dtype
        blocks = runner.hello().num_gpu_blocks
        sizes[name] = (blocks, blocks * runner.kv_cache.layout.bytes_per_block)
    assert sizes["float32"][0] == DEFAULT_CPU_BLOCKS
    assert sizes["bfloat16"][0] == 2 * DEFAULT_CPU_BLOCKS
    assert sizes["bfloat16"][1] == sizes["float32"][1]  # the same memory
