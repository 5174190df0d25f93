"""The aligned buffer pool and the asynchronous O_DIRECT IO layer (tiertrain.offload)."""
import errno
import fcntl
import os
import random
import threading
import time

import pytest
import torch

from tiertrain.io import (AlignedBufferPool, AsyncIO, PoolExhaustedError, SwapCorruptionError, SwapDirError,
                          SwapSpaceError)
from tiertrain.io import aio as aio_mod

T = 20  # seconds: every wait in these tests is bounded
pytestmark = [pytest.mark.timeout(120),  # a hang fails the test instead of the run
              pytest.mark.usefixtures("one_torch_thread")]
SIZES = [0, 1, 4095, 4096, 4097, (1 << 20) + 3, 20 << 20]


@pytest.fixture
def pool():
    return AlignedBufferPool(48 << 20, 1 << 20, pin=False, acquire_timeout=T)


def _fill(buf, seed):
    if buf.nbytes:
        buf.data.copy_(torch.frombuffer(bytearray(random.Random(seed).randbytes(buf.nbytes)),
                                        dtype=torch.uint8))
    return buf.data.clone()


# ------------------------------------------------------------------------------ buffer pool
def test_pool_buffers_are_aligned_and_view_as_any_dtype_without_copy(pool):
    with pool.acquire(4097) as b:
        assert b.address % 4096 == 0 and b.nbytes == 4097 and b.capacity == 1 << 20
        assert b.data.dtype == torch.uint8 and b.data.numel() == 4097
    with pool.acquire(3 * 4096) as b:
        f = b.view(torch.float32, (3, 1024))
        bf = b.view(torch.bfloat16)
        i = b.view(torch.int64)
        assert f.data_ptr() == bf.data_ptr() == i.data_ptr() == b.address
        f.fill_(1.5)
        assert b.view(torch.float32)[5].item() == 1.5
    assert pool.bytes_in_use == 0


def test_pool_reuses_the_same_memory(pool):
    addrs = set()
    for _ in range(20):
        with pool.acquire(1 << 20) as b:
            addrs.add(b.address)
    assert len(addrs) == 1
    assert pool.peak_blocks_in_use == 1


def test_pool_exhaustion_times_out_with_a_clear_error(pool):
    held = [pool.acquire(16 << 20) for _ in range(3)]   # the whole 48 MiB budget
    t0 = time.monotonic()
    with pytest.raises(PoolExhaustedError, match=r"exhausted: 1 bytes .* 50331648 bytes in use"):
        pool.acquire(1, timeout=0.2)
    assert time.monotonic() - t0 < 5
    assert pool.try_acquire(1) is None
    with pytest.raises(ValueError, match="whole budget"):
        pool.acquire(49 << 20)
    # a waiter is woken by a release on another thread
    got = []
    th = threading.Thread(target=lambda: got.append(pool.acquire(8 << 20, timeout=T)))
    th.start()
    time.sleep(0.05)
    held.pop().release()
    th.join(T)
    assert got and got[0].nbytes == 8 << 20
    for b in held + got:
        b.release()
        b.release()                                     # idempotent
    assert pool.bytes_in_use == 0


def test_pool_concurrent_acquire_release(pool):
    errors = []

    def worker(seed):
        try:
            for k in range(50):
                with pool.acquire(((seed * 7 + k) % 5 + 1) << 20, timeout=T) as b:
                    b.data[:1] = seed
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ths = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(T)
    assert not errors and pool.bytes_in_use == 0


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_every_size(tmp_path, pool, aio, n):
    path = tmp_path / "f.bin"
    with pool.acquire(n) as b:
        want = _fill(b, n)
        w = aio.submit_write(path, b, 0)
        assert w.wait(T) == n
        assert w.direct == (n > 0 and aio.direct_supported(path) is not False)
    # O_DIRECT pads the file to the page; a filesystem that refuses O_DIRECT gets n bytes
    assert os.path.getsize(path) == (-(-n // 4096) * 4096 if w.direct else n)
    with pool.acquire(n) as b:
        b.padded.fill_(0xEE)
        r = aio.submit_read(path, b, 0, checksum=w.checksum)
        assert r.wait(T) == n
        assert torch.equal(b.data, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_round_trip_dtypes(tmp_path, pool, aio, dtype):
    x = torch.randn(300_001).to(dtype) if dtype != torch.int64 else torch.randint(-2**62, 2**62, (300_001,))
    nbytes = x.numel() * x.element_size()
    with pool.acquire(nbytes) as b:
        b.view(dtype).copy_(x)
        w = aio.submit_write(tmp_path / "x", b)
        w.wait(T)
    with pool.acquire(nbytes) as b:
        aio.submit_read(tmp_path / "x", b, checksum=w.checksum).wait(T)
        assert torch.equal(b.view(dtype), x)


def test_a_page_aligned_range_of_a_tensor_goes_to_disk_and_back_with_no_copy(tmp_path, aio):
    """page_aligned_empty + tensor_range_buffer: a range starting at a page boundary of a tensor
    is written and read in place (O_DIRECT where the filesystem allows). A range ending inside a
    page leaves the bytes after it alone: a write sends them as they are (not zeroed, they are
    the next range's) and a read does not land on them. A range not starting at a page boundary
    has no such buffer (the swap layer copies through its pool)."""
    from tiertrain.io.buffers import page_aligned_empty, tensor_range_buffer

    t = page_aligned_empty(3000, torch.float32)
    assert t.data_ptr() % 4096 == 0 and t.numel() == 3000
    t.copy_(torch.arange(3000, dtype=torch.float32))
    whole_page, part_page = tensor_range_buffer(t, 0, 1024), tensor_range_buffer(t, 1024, 1500)
    assert whole_page.address == t.data_ptr() and whole_page.nbytes == 4096
    assert part_page.address == t[1024:].data_ptr() and part_page.nbytes == 476 * 4
    assert tensor_range_buffer(t, 10, 1024) is None  # (not at a page boundary)
    assert tensor_range_buffer(torch.empty(1000)[1:], 0, 999) is None
    w1, w2 = aio.submit_write(tmp_path / "a", whole_page), aio.submit_write(tmp_path / "b", part_page)
    w1.wait(T), w2.wait(T)
    direct = aio.direct_supported(tmp_path / "a") is not False  # (known once a write ran)
    assert w1.direct == direct and w2.direct == direct
    assert torch.equal(t, torch.arange(3000, dtype=torch.float32))  # (the tail after 1500 was not zeroed)
    t.fill_(-1.0)
    r1 = aio.submit_read(tmp_path / "a", tensor_range_buffer(t, 0, 1024), checksum=w1.checksum)
    r2 = aio.submit_read(tmp_path / "b", tensor_range_buffer(t, 1024, 1500), checksum=w2.checksum)
    r1.wait(T), r2.wait(T)
    assert r1.direct == direct and not r2.direct  # (a whole page would land on elements 1500..2047)
    assert torch.equal(t[:1500], torch.arange(1500, dtype=torch.float32))
    assert bool((t[1500:] == -1.0).all())


def test_unaligned_buffers_and_offsets_go_through_the_page_cache(tmp_path, aio):
    x = torch.arange(1001, dtype=torch.int32)           # plain tensor: not a pool buffer
    h = aio.submit_write(tmp_path / "u", x, offset=7)
    h.wait(T)
    assert not h.direct
    y = torch.zeros_like(x)
    aio.submit_read(tmp_path / "u", y, offset=7, checksum=h.checksum).wait(T)
    assert torch.equal(x, y)
    aio.submit_write(tmp_path / "b", b"hello").wait(T)
    out = bytearray(5)
    aio.submit_read(tmp_path / "b", out).wait(T)
    assert out == b"hello"
    assert aio.stats["buffered_requests"] == 4


def test_concurrent_requests(tmp_path, pool, aio):
    bufs, wants, handles = [], [], []
    for i in range(24):                                  # 24 regions of one file + 8 files
        b = pool.acquire(256 << 10)
        wants.append(_fill(b, i))
        bufs.append(b)
        handles.append(aio.submit_write(tmp_path / "many", b, i << 18))
    for i in range(8):
        b = pool.acquire(100_000 + i)
        wants.append(_fill(b, 100 + i))
        bufs.append(b)
        handles.append(aio.submit_write(tmp_path / f"f{i}", b))
    aio.flush(timeout=T)
    assert all(h.done() for h in handles)
    for b in bufs:
        b.padded.zero_()
    reads = [aio.submit_read(tmp_path / "many", bufs[i], i << 18, checksum=handles[i].checksum)
             for i in range(24)]
    reads += [aio.submit_read(tmp_path / f"f{i}", bufs[24 + i], checksum=handles[24 + i].checksum)
              for i in range(8)]
    for r in reads:
        r.wait(T)
    for b, want in zip(bufs, wants):
        assert torch.equal(b.data, want)
        b.release()


def test_checksum_is_optional(tmp_path, pool):
    with AsyncIO(2, 1 << 20, checksum=None) as io, pool.acquire(5000) as b:
        h = io.submit_write(tmp_path / "c", b)
        h.wait(T)
        assert h.checksum is None
        io.submit_read(tmp_path / "c", b).wait(T)
    with pytest.raises(ValueError, match="checksum must be one of"):
        AsyncIO(checksum="md5")


def test_sum64_sees_single_bytes_pages_and_tails():
    data = bytearray(random.Random(5).randbytes(3 * 4096 + 77))
    ref = aio_mod.sum64(data)
    for pos in (0, 4095, 4096 + 100, 3 * 4096 + 76):      # every byte position kind, tail too
        for flip in (0x01, 0x80):
            d = bytearray(data)
            d[pos] ^= flip
            assert aio_mod.sum64(d) != ref
    swapped = data[4096:8192] + data[:4096] + data[8192:]  # two pages in each other's place
    assert aio_mod.sum64(swapped) != ref
    zeroed = data[:4096] + bytes(4096) + data[8192:]
    assert aio_mod.sum64(zeroed) != ref
    assert aio_mod.sum64(b"") == 0


def test_the_default_checksum_is_xxh3_which_also_sees_words_swapped_within_a_page(tmp_path, pool):
    """Two 8-byte words of one page in each other's place keep sum64's sums (its documented
    blind spot); the default, XXH3, hashes every byte in order and sees it. Its CPU time is
    counted."""
    assert AsyncIO().checksum == aio_mod.DEFAULT_CHECKSUM == "xxh3"
    data = bytearray(random.Random(6).randbytes(2 * 4096))
    swapped = bytearray(data)
    swapped[8:16], swapped[16:24] = data[16:24], data[8:16]
    assert aio_mod.sum64(swapped) == aio_mod.sum64(data)
    path = tmp_path / "w"
    with AsyncIO(2, 1 << 20) as io, pool.acquire(len(data)) as b:
        b.data[:len(data)].copy_(torch.frombuffer(bytes(data), dtype=torch.uint8))
        w = io.submit_write(path, b)
        w.wait(T)
        with open(path, "r+b") as f:
            f.write(bytes(swapped[:4096]))
        with pytest.raises(SwapCorruptionError, match=rf"checksum mismatch in {path}: xxh3"):
            io.submit_read(path, b, checksum=w.checksum).wait(T)
        assert io.cpu_seconds["checksum"] >= 0.0


def test_preallocation_is_skipped_where_unsupported_and_reports_no_space(tmp_path, pool, monkeypatch):
    calls = []

    def unsupported(fd, off, length):
        calls.append((off, length))
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(aio_mod, "_fallocate", unsupported)
    with AsyncIO(2, 1 << 20) as io, pool.acquire(2 << 20) as b:
        want = _fill(b, 9)
        io.submit_write(tmp_path / "p", b, 4096).wait(T)
        assert calls == [(4096, 2 << 20)]
        io.submit_write(tmp_path / "p", b, 4096).wait(T)   # inside the file: no preallocation
        assert len(calls) == 1
        b.padded.zero_()
        io.submit_read(tmp_path / "p", b, 4096).wait(T)
        assert torch.equal(b.data, want)

    def full(fd, off, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio_mod, "_fallocate", full)
    with AsyncIO(2, 1 << 20) as io, pool.acquire(3 << 20) as b:
        h = io.submit_write(tmp_path / "q", b)
        with pytest.raises(SwapSpaceError, match=rf"writing 3145728 bytes to {tmp_path / 'q'}"):
            h.wait(T)


# ------------------------------------------------------------------------------ O_DIRECT refusal
def test_fallback_when_open_refuses_o_direct(tmp_path, pool, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(aio_mod.os, "open", no_direct)
    with AsyncIO(2, 1 << 20) as io, pool.acquire(3 << 20) as b:
        want = _fill(b, 1)
        h = io.submit_write(tmp_path / "nd", b)
        h.wait(T)
        assert not h.direct and io.direct_supported(tmp_path / "nd") is False
        assert len(io.notes) == 1 and "O_DIRECT refused" in io.notes[0] and str(tmp_path) in io.notes[0]
        b.padded.zero_()
        io.submit_read(tmp_path / "nd", b, checksum=h.checksum).wait(T)
        assert torch.equal(b.data, want)
        assert os.path.getsize(tmp_path / "nd") == 3 << 20   # buffered: no page padding


def test_fallback_when_the_first_transfer_refuses_o_direct(tmp_path, pool, monkeypatch):
    real = os.pwritev

    def einval_if_direct(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)

    monkeypatch.setattr(aio_mod.os, "pwritev", einval_if_direct)
    with AsyncIO(4, 1 << 20) as io, pool.acquire(5 << 20) as b:
        want = _fill(b, 2)
        h = io.submit_write(tmp_path / "nd", b)
        h.wait(T)
        assert "EINVAL on the first transfer" in io.notes[0]
        b.padded.zero_()
        io.submit_read(tmp_path / "nd", b, checksum=h.checksum).wait(T)
        assert torch.equal(b.data, want)


# ------------------------------------------------------------------------------ errors
def test_missing_directory_names_the_path(tmp_path, pool, aio):
    path = tmp_path / "nope" / "f"
    with pool.acquire(10) as b, pytest.raises(SwapDirError, match=str(path)):
        aio.submit_write(path, b)
    (tmp_path / "file").write_bytes(b"x")
    with pool.acquire(10) as b, pytest.raises(SwapDirError, match="Not a directory"):
        aio.submit_write(tmp_path / "file" / "f", b)


def test_truncated_file_is_a_short_read(tmp_path, pool, aio):
    path = tmp_path / "t"
    with pool.acquire((2 << 20) + 5) as b:
        _fill(b, 3)
        aio.submit_write(path, b).wait(T)
        os.truncate(path, 1 << 20)
        with pytest.raises(SwapCorruptionError, match=rf"short read from {path}: expected 2097157 "
                                                      r"bytes at offset 0, the file holds only 1048576") as e:
            aio.submit_read(path, b).wait(T)
        assert e.value.path == str(path) and e.value.expected_bytes == 2097157
        assert e.value.actual_bytes == 1 << 20
        os.truncate(path, 5000)                          # not a page multiple
        with pytest.raises(SwapCorruptionError, match="holds only 5000"):
            aio.submit_read(path, b).wait(T)


@pytest.mark.parametrize("kind", ["xxh3", "sum64", "crc32", "adler32"])
def test_corrupted_byte_fails_the_checksum(tmp_path, pool, kind):
    path = tmp_path / "c"
    with AsyncIO(4, 1 << 20, checksum=kind) as io, pool.acquire(3 << 20) as b:
        _fill(b, 4)
        w = io.submit_write(path, b)
        w.wait(T)
        assert w.checksum.kind == kind and len(w.checksum.values) == 3
        io.submit_read(path, b, checksum=w.checksum).wait(T)      # intact: passes
        with open(path, "r+b") as f:
            f.seek((2 << 20) + 17)
            c = f.read(1)
            f.seek((2 << 20) + 17)
            f.write(bytes([c[0] ^ 0x01]))
        with pytest.raises(SwapCorruptionError,
                           match=rf"checksum mismatch in {path}: {kind} of bytes 2097152\.\.3145728"):
            io.submit_read(path, b, checksum=w.checksum).wait(T)


def test_no_space_maps_to_swap_space_error(tmp_path, pool, monkeypatch):
    for code, text in [(errno.ENOSPC, "No space left on device"), (errno.EFBIG, "EFBIG")]:
        def full(fd, bufs, off, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(aio_mod.os, "pwritev", full)
        with AsyncIO(2, 1 << 20) as io, pool.acquire(3 << 20) as b:
            h = io.submit_write(tmp_path / "full", b)
            with pytest.raises(SwapSpaceError, match=rf"writing 3145728 bytes to {tmp_path / 'full'}.*{text}") as e:
                h.wait(T)
            assert e.value.requested_bytes == 3 << 20 and e.value.errno == code
    monkeypatch.undo()


def test_wait_timeout_and_flush_report_errors(tmp_path, pool, monkeypatch):
    real = os.pwritev

    def slow(fd, bufs, off):
        time.sleep(0.5)
        return real(fd, bufs, off)

    monkeypatch.setattr(aio_mod.os, "pwritev", slow)
    io = AsyncIO(2, 1 << 20)
    with pool.acquire(100) as b:
        h = io.submit_write(tmp_path / "slow", b)
        with pytest.raises(TimeoutError, match=str(tmp_path / "slow")):
            h.wait(0.01)
        with pytest.raises(TimeoutError):
            io.flush(timeout=0.01)
        io.flush(timeout=T)
        assert h.wait(T) == 100
    monkeypatch.undo()
    # an error nobody waited for comes out of flush()
    with pool.acquire(10) as b:
        io.submit_write(tmp_path / "ok", b).wait(T)
        os.truncate(tmp_path / "ok", 0)
        io.submit_read(tmp_path / "ok", b)
        with pytest.raises(SwapCorruptionError, match="short read"):
            io.flush(timeout=T)
        io.flush(timeout=T)                              # reported once
    io.close(T)
    io.close(T)
    with pytest.raises(RuntimeError, match="closed"):
        io.submit_write(tmp_path / "x", b"1")
