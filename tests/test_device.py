"""`device=` everywhere: a device this machine does not have is a ValueError naming `device`."""

from __future__ import annotations

import pytest
import torch

import minifer as mf
from minifer.device import as_device


@pytest.fixture
def no_gpu(monkeypatch):
    """Pretend to be a CPU-only build, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_as_device_accepts_what_exists():
    assert as_device("cpu") == torch.device("cpu")
    assert as_device(torch.device("cpu")) == torch.device("cpu")
    assert as_device("meta").type == "meta"


@pytest.mark.parametrize("bad", ["cuda", "cuda:0", torch.device("cuda"), "mps", 0])
def test_missing_accelerator_is_a_value_error(no_gpu, bad):
    with pytest.raises(ValueError, match=r"device.*not available"):
        as_device(bad)


@pytest.mark.parametrize("bad", ["gpu", "", None, 1.5])
def test_unknown_device_is_a_value_error(bad):
    with pytest.raises(ValueError, match="device must be"):
        as_device(bad)


def test_cuda_index_past_the_last_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert as_device("cuda:0").index == 0
    with pytest.raises(ValueError, match=r"device='cuda:3'.*1 CUDA device"):
        as_device("cuda:3")


def test_entry_points_check_the_device(no_gpu, tiny):
    with pytest.raises(ValueError, match="device"):
        mf.GPT.from_config("tiny", device="cuda")
    with pytest.raises(ValueError, match="device"):
        mf.StaticKVCache(1, 1, 1, 4, 4, device="cuda")
    with pytest.raises(ValueError, match="device"):
        mf.StaticKVCache.for_model(tiny, 1, device="cuda")
    with pytest.raises(ValueError, match="device"):
        mf.load_pretrained("shakespeare-draft", device="cuda")


@pytest.fixture
def memory_sources(monkeypatch, tmp_path):
    """`available_memory`'s sources faked: MemAvailable 8 GiB, no cgroup files, no RLIMIT_AS;
    `set(name, text)` writes one (``meminfo``, ``statm``, ``v2.max``, ``v1.limit``, ...)."""
    import resource

    import minifer.device as dev

    cg = tmp_path / "cgroup"
    files = {"meminfo": tmp_path / "meminfo", "statm": tmp_path / "statm",
             "self": tmp_path / "self_cgroup", "v2.max": cg / "memory.max",
             "v2.current": cg / "memory.current", "v1.limit": cg / "memory/memory.limit_in_bytes",
             "v1.usage": cg / "memory/memory.usage_in_bytes",
             "own.limit": cg / "memory/laptop/memory.limit_in_bytes",
             "own.usage": cg / "memory/laptop/memory.usage_in_bytes"}
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    for name, value in (("MEMINFO", files["meminfo"]), ("STATM", files["statm"]),
                        ("SELF_CGROUP", files["self"]), ("CGROUP", cg)):
        monkeypatch.setattr(dev, name, value, raising=False)  # (before issue 56: not read)
    limits = {"as": resource.RLIM_INFINITY}
    monkeypatch.setattr(resource, "getrlimit", lambda which: (
        (limits["as"], resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else (-1, -1)))
    files["meminfo"].write_text(f"MemTotal: {16 << 20} kB\nMemAvailable: {8 << 20} kB\n")

    def put(name: str, text) -> None:
        if name == "rlimit_as":
            limits["as"] = text
        else:
            files[name].write_text(f"{text}\n")
    return put


GiB = 1 << 30


def test_available_memory_is_memavailable_without_other_limits(memory_sources):
    from minifer.device import available_memory

    assert available_memory("cpu") == 8 * GiB
    memory_sources("v2.max", "max")  # cgroup v2 without a limit
    memory_sources("v2.current", 5 * GiB)
    memory_sources("v1.limit", 9223372036854771712)  # cgroup v1 without a limit: a huge number
    memory_sources("v1.usage", 5 * GiB)
    assert available_memory("cpu") == 8 * GiB


@pytest.mark.parametrize("limit, usage", [("v2.max", "v2.current"), ("v1.limit", "v1.usage")])
def test_available_memory_is_what_the_cgroup_leaves(memory_sources, limit, usage):
    """In a container MemAvailable is the host's: the cgroup's limit less its usage wins."""
    from minifer.device import available_memory

    memory_sources(limit, 4 * GiB)
    memory_sources(usage, 3 * GiB)
    assert available_memory("cpu") == GiB
    memory_sources(usage, 5 * GiB)  # over its limit (reclaim pending): nothing, not negative
    assert available_memory("cpu") == 0


def test_available_memory_is_what_this_process_cgroup_leaves(memory_sources):
    """A process in a cgroup of its own below the root (/proc/self/cgroup names it: systemd's
    slices, ``cgexec``): that cgroup's limit, not only the root's."""
    from minifer.device import available_memory

    memory_sources("own.limit", 4 * GiB)
    memory_sources("own.usage", GiB)
    assert available_memory("cpu") == 8 * GiB  # not this process's cgroup
    memory_sources("self", "12:cpu,cpuacct:/\n4:memory:/laptop\n0::/")
    assert available_memory("cpu") == 3 * GiB


def test_available_memory_is_what_ulimit_v_leaves(memory_sources):
    """RLIMIT_AS less this process's virtual size (/proc/self/statm's first field, in pages)."""
    import os

    from minifer.device import available_memory

    page = os.sysconf("SC_PAGE_SIZE")
    memory_sources("rlimit_as", 3 * GiB)
    memory_sources("statm", f"{GiB // page} 1000 500 10 0 900 0")  # 1 GiB mapped
    assert available_memory("cpu") == 2 * GiB
    memory_sources("v2.max", GiB + 5)  # the least of them all wins
    memory_sources("v2.current", 5)
    assert available_memory("cpu") == GiB
    memory_sources("rlimit_as", GiB)  # already used up
    assert available_memory("cpu") == 0


def test_available_memory_falls_back_to_half_the_ram(memory_sources, tmp_path):
    import os

    import minifer.device as dev

    (tmp_path / "meminfo").unlink()  # not Linux: half the RAM, within the other limits
    assert dev.available_memory("cpu") == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    memory_sources("v1.limit", 1000)
    memory_sources("v1.usage", 10)
    assert dev.available_memory("cpu") == 990


def test_the_pool_fraction_is_of_what_the_cgroup_leaves(memory_sources):
    """kv_cache_memory as a fraction sizes the pool down to a container's limit (issue 56)."""
    from minifer.engine.config import EngineConfig

    model = mf.GPT.from_config("tiny", seed=0)
    c = model.config
    per_block = 2 * c.n_layer * c.kv_heads * c.head_dim * 4 * 16  # (K, V) fp32, 16 tokens a block
    memory_sources("v2.max", 10 * per_block)
    memory_sources("v2.current", 0)
    config = EngineConfig(kv_cache_memory=0.5, max_num_seqs=64).resolved(model)
    assert config.num_blocks == 5
