"""TensorSwapper: per-rank swap files over the async O_DIRECT layer, and its fault handling.

Fault set-ups that work for root too (tests here may run as root, where chmod does not stop
writes): an unwritable location is a path under a regular FILE (ENOTDIR for everyone) and, where
user+mount namespaces are available (``unshare -rm``), a read-only tmpfs (EROFS); a full disk is
a 2 MiB tmpfs mounted in a private mount namespace (ENOSPC) and, everywhere, a subprocess with
RLIMIT_FSIZE and SIGXFSZ ignored (writes past the limit fail with EFBIG). Both map to
SwapSpaceError naming the path and the bytes requested.
"""
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from tiertrain.io import AlignedBufferPool, SwapCorruptionError, SwapDirError, TensorSwapper

T = 20
pytestmark = [pytest.mark.timeout(120),  # a hang fails the test instead of the run
              pytest.mark.usefixtures("one_torch_thread")]
SIZES = [0, 1, 4095, 4096, 4097, (1 << 20) + 3, 20 << 20]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


@pytest.fixture
def pool():
    # 8 MiB budget, 1 MiB blocks: pieces of 4 MiB, so 20 MiB tensors stream through the pool
    return AlignedBufferPool(8 << 20, 1 << 20, pin=False, acquire_timeout=T)


@pytest.fixture
def swapper(tmp_path, aio, pool):
    s = TensorSwapper(tmp_path, aio, pool, rank=0, wait_timeout=T)
    yield s
    s.close()


def _tensor(nbytes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = nbytes // torch.empty(0, dtype=dtype).element_size()
    if dtype == torch.int64:
        return torch.randint(-2**62, 2**62, (n,), generator=g)
    return torch.randn(n, generator=g).to(dtype)


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_sizes_and_dtypes(swapper, pool, nbytes):
    xs = {dtype: _tensor(nbytes, dtype, seed=nbytes % 1000) for dtype in DTYPES}
    xs[torch.uint8] = torch.arange(nbytes, dtype=torch.uint8)   # exactly nbytes, odd sizes too
    for dtype, x in xs.items():
        swapper.swap_out((nbytes, str(dtype)), x.clone())  # the original copy may go away
    for dtype, x in xs.items():
        out = torch.full_like(x, 7) if x.numel() else torch.empty_like(x)
        got = swapper.swap_in((nbytes, str(dtype)), out).wait(T)
        assert got is out and torch.equal(out, x)
        assert torch.equal(swapper.swap_in((nbytes, str(dtype))).wait(T), x)  # allocate
    assert pool.bytes_in_use == 0


def test_shapes_odd_dtypes_and_overwrite(swapper):
    x = torch.randn(3, 5, 7).to(torch.bfloat16)
    swapper.swap_out("w", x)
    y = swapper.swap_in("w").wait(T)
    assert y.shape == (3, 5, 7) and y.dtype == torch.bfloat16 and torch.equal(x, y)
    b = torch.tensor([True, False, True])
    swapper.swap_out("w", b)                              # same key, smaller: replaced
    assert torch.equal(swapper.swap_in("w").wait(T), b)
    t = torch.arange(12.0).view(3, 4).t()                 # non-contiguous source
    swapper.swap_out("t", t)
    assert torch.equal(swapper.swap_in("t").wait(T), t)
    s = torch.tensor(3.25, dtype=torch.float64)           # 0-dim
    swapper.swap_out("s", s)
    assert swapper.swap_in("s").wait(T).item() == 3.25
    with pytest.raises(ValueError, match=r"destination has 4 bytes .* the swapped tensor 8"):
        swapper.swap_in("s", torch.empty(1, dtype=torch.float32))
    with pytest.raises(KeyError, match="never swapped out"):
        swapper.swap_in("missing")


def test_swap_out_source_can_be_reused_immediately(swapper):
    x = torch.arange(1 << 20, dtype=torch.float32)
    want = x.clone()
    h = swapper.swap_out("x", x)
    x.fill_(-1)                                           # reused before the write finished
    del x
    h.wait(T)
    assert torch.equal(swapper.swap_in("x").wait(T), want)


def test_zero_copy_pool_buffers(tmp_path, aio):
    pool = AlignedBufferPool(16 << 20, 1 << 20, pin=False, acquire_timeout=T)
    with TensorSwapper(tmp_path, aio, pool, rank=3, wait_timeout=T) as sw:
        assert sw.rank_dir.endswith("rank3")
        src = pool.acquire(3 * 1024 * 1024 + 12)
        src.view(torch.uint8).copy_(torch.arange(src.nbytes) % 251)
        sw.swap_out("b", src).wait(T)                     # written from the buffer itself
        dst = pool.acquire(src.nbytes)
        assert sw.swap_in("b", dst).wait(T) is dst
        assert torch.equal(dst.data, src.data)
        # a tensor swapped in pieces, read straight into one pool buffer
        x = torch.randn(5 << 20 >> 2)
        sw.swap_out("t", x)
        with pool.acquire(5 << 20) as d2:
            sw.swap_in("t", d2).wait(T)
            assert torch.equal(d2.view(torch.float32), x)
        src.release()
        dst.release()


def test_a_prefetched_key_read_into_a_pool_buffer_gets_its_bytes(tmp_path, aio):
    """A key one user prefetched (a stage-3 gather, ahead of use) and another reads straight
    into a pool buffer (the NVMe optimizer's ring): the buffer receives the prefetched bytes."""
    pool = AlignedBufferPool(16 << 20, 1 << 20, pin=False, acquire_timeout=T)
    with TensorSwapper(tmp_path, aio, pool, rank=0, wait_timeout=T) as sw:
        x = torch.randn(3 << 18)
        sw.swap_out("k", x).wait(T)
        assert sw.prefetch(["k"]) >= 1
        sw.flush(T)
        with pool.acquire(x.numel() * 4) as dst:
            dst.data.fill_(0)
            sw.swap_in("k", dst).wait(T)
            assert torch.equal(dst.view(torch.float32), x)
        assert sw.stats["prefetch_hits"] >= 1


def test_concurrent_swaps_from_threads(swapper, pool):
    errors = []

    def worker(t):
        try:
            for k in range(10):
                x = torch.full((1000 * (t + 1) + k,), float(t * 100 + k))
                swapper.swap_out((t, k), x)
            for k in range(10):
                y = swapper.swap_in((t, k)).wait(T)
                assert y.numel() == 1000 * (t + 1) + k and bool((y == t * 100 + k).all())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(T)
    assert not errors
    swapper.flush(T)
    assert pool.bytes_in_use == 0 and len(swapper.keys()) == 60


@pytest.mark.parametrize("nbytes", [1, 4097, 512 << 10, (1 << 20) + 3, 6 << 20])
def test_prefetch_small_and_large_partitions(swapper, pool, nbytes):
    """DeepSpeed keeps partitions under 1 MiB in memory and its prefetcher then breaks on them;
    here every size goes through the same prefetch path."""
    xs = {i: torch.arange(nbytes, dtype=torch.uint8) + i for i in range(4)}
    for i, x in xs.items():
        swapper.swap_out(i, x)                            # writes still in flight
    swapper.prefetch([0, 1])                              # chained after the writes
    swapper.flush(T)
    swapper.prefetch([2, 3])
    for i, x in xs.items():
        assert torch.equal(swapper.swap_in(i).wait(T), x)
    assert swapper.stats["prefetch_hits"] + swapper.stats["prefetch_skipped"] >= 1
    if nbytes <= 1 << 20:
        assert swapper.stats["prefetch_hits"] == 4
    swapper.prefetch([0])
    swapper.release(0)                                    # release with a prefetch in flight
    assert pool.bytes_in_use == 0


def test_release_deletes_the_file(swapper):
    swapper.swap_out("r", torch.ones(10)).wait(T)
    path = swapper._records["r"].path
    assert os.path.exists(path)
    swapper.release("r")
    assert not os.path.exists(path) and "r" not in swapper
    with pytest.raises(KeyError):
        swapper.swap_in("r")


# ------------------------------------------------------------------------------ directories
def test_rank_dir_created_locked_and_removed(tmp_path, aio, pool):
    sw = TensorSwapper(tmp_path, aio, pool, rank=1, wait_timeout=T)
    assert os.path.isdir(tmp_path / "rank1")
    # (the holder is named: a second job given the same zero.nvme_path learns which process to stop)
    with pytest.raises(SwapDirError, match=rf"{tmp_path / 'rank1'} is in use by another live process \(host .*, "
                                           rf"pid {os.getpid()}, since"):
        TensorSwapper(tmp_path, aio, pool, rank=1, wait_timeout=T)
    sw.swap_out("a", torch.ones(5))
    sw.close()
    sw.close()
    assert not os.path.exists(tmp_path / "rank1") and os.path.isdir(tmp_path)
    with pytest.raises(RuntimeError, match="closed"):
        sw.swap_out("b", torch.ones(1))
    # stale files of a crashed run are cleared
    os.makedirs(tmp_path / "rank2")
    (tmp_path / "rank2" / "000001_old.swp").write_bytes(b"junk")
    with TensorSwapper(tmp_path, aio, pool, rank=2, wait_timeout=T):
        assert os.listdir(tmp_path / "rank2") == [".lock"]


def test_missing_and_unwritable_swap_dir(tmp_path, aio, pool):
    with pytest.raises(SwapDirError, match=rf"{tmp_path / 'nope'} does not exist"):
        TensorSwapper(tmp_path / "nope", aio, pool)
    with TensorSwapper(tmp_path / "made", aio, pool, create=True, wait_timeout=T):
        assert os.path.isdir(tmp_path / "made" / "rank0")
    assert not os.path.exists(tmp_path / "made")          # created by us, removed by us
    # under a regular file: ENOTDIR, which stops root as well
    (tmp_path / "plain").write_bytes(b"")
    bad = tmp_path / "plain" / "swap"
    with pytest.raises(SwapDirError, match=rf"{bad} is not usable: a component .* regular file") as e:
        TensorSwapper(bad, aio, pool)
    assert e.value.path == str(bad)
    with pytest.raises(SwapDirError, match=rf"{tmp_path / 'plain'} is not a directory"):
        TensorSwapper(tmp_path / "plain", aio, pool)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_chmod_read_only_dir(tmp_path, aio, pool):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(SwapDirError, match=str(ro)):
            TensorSwapper(ro, aio, pool)
    finally:
        ro.chmod(0o700)


# ------------------------------------------------------------------------------ corruption
def test_truncated_swap_file(swapper):
    x = torch.randn(3 << 20 >> 2)
    swapper.swap_out("t", x).wait(T)
    path = swapper._records["t"].path
    os.truncate(path, 1 << 20)
    with pytest.raises(SwapCorruptionError, match=rf"short read from {path}.*holds only") as e:
        swapper.swap_in("t").wait(T)
    assert e.value.path == path
    assert (e.value.expected_bytes, e.value.actual_bytes) == (3 << 20, 1 << 20)
    swapper.prefetch(["t"])                               # a prefetch reports it at swap_in too
    with pytest.raises(SwapCorruptionError, match=path):
        swapper.swap_in("t").wait(T)


def test_corrupted_swap_file(swapper):
    x = torch.randn(12345)
    swapper.swap_out("c", x).wait(T)
    path = swapper._records["c"].path
    with open(path, "r+b") as f:
        f.seek(999)
        c = f.read(1)
        f.seek(999)
        f.write(bytes([c[0] ^ 0x80]))
    with pytest.raises(SwapCorruptionError, match=rf"checksum mismatch in {path}"):
        swapper.swap_in("c").wait(T)


# ------------------------------------------------------------------------------ full disk
CHILD = r"""
import json, os, resource, signal, sys, torch
from tiertrain.io import *
mode, root = sys.argv[1], sys.argv[2]
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = "no error"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
        out[name + ".bytes"] = getattr(e, "requested_bytes", None)
pool = AlignedBufferPool(8 << 20, 1 << 20, pin=False, acquire_timeout=20)
aio = AsyncIO(2, 1 << 20)
if mode == "tmpfs":
    sw = TensorSwapper(os.path.join(root, "small"), aio, pool, wait_timeout=20)
    sw.swap_out("fits", torch.ones(1000)).wait(20)
    attempt("full", lambda: sw.swap_out("big", torch.ones(1 << 20)).wait(20))   # 4 MiB > 2 MiB
    out["readback"] = bool((sw.swap_in("fits").wait(20) == 1).all())
    sw.close()
    attempt("ro", lambda: TensorSwapper(os.path.join(root, "ro"), aio, pool, wait_timeout=20))
else:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # else the kernel kills us on EFBIG
    sw = TensorSwapper(os.path.join(root, "lim"), aio, pool, create=True, wait_timeout=20)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    sw.swap_out("fits", torch.ones(1000)).wait(20)
    attempt("full", lambda: sw.swap_out("big", torch.ones(1 << 20)).wait(20))
    out["readback"] = bool((sw.swap_in("fits").wait(20) == 1).all())
    # left open on purpose: the exit finaliser must remove the rank directory
    out["rank_dir"] = sw.rank_dir
print("RESULT" + json.dumps(out))
"""


def _run_child(args, root):
    p = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


def _unshare_tmpfs_works(d):
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {d}"],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_full_disk_and_read_only_tmpfs(tmp_path):
    for d in ("small", "ro"):
        (tmp_path / d).mkdir()
    if not _unshare_tmpfs_works(tmp_path / "small"):
        pytest.skip("no user+mount namespaces here (unshare -rm): covered by the RLIMIT_FSIZE test")
    small, ro = tmp_path / "small", tmp_path / "ro"
    script = (f"mount -t tmpfs -o size=2m tmpfs {small} && mount -t tmpfs -o ro,size=1m tmpfs {ro} "
              f"&& exec {sys.executable} -c '{CHILD}' tmpfs {tmp_path}")
    r = _run_child(["unshare", "-rm", "sh", "-c", script], tmp_path)
    assert r["full"].startswith("SwapSpaceError: out of swap space writing 4194304 bytes to "
                                f"{small}/rank0/"), r
    assert "No space left on device" in r["full"] and r["full.bytes"] == 4 << 20
    assert r["readback"] is True
    assert r["ro"].startswith("SwapDirError: cannot create per-rank swap directory "
                              f"{ro}/rank0: Read-only file system"), r


@pytest.mark.slow
def test_full_disk_via_file_size_limit(tmp_path):
    r = _run_child([sys.executable, "-c", CHILD, "rlimit", str(tmp_path)], tmp_path)
    assert r["full"].startswith("SwapSpaceError: out of swap space writing 4194304 bytes to "
                                f"{tmp_path}/lim/rank0/"), r
    assert "EFBIG" in r["full"] and r["full.bytes"] == 4 << 20
    assert r["readback"] is True
    assert not os.path.exists(r["rank_dir"]), "the exit finaliser left the swap directory"
