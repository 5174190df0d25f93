"""NVMeAdamW: ZeRO-Infinity's optimizer step from NVMe (docs/concepts.md#optimizer-step-with-nvme) — fp32 masters and Adam
moments live in swap files and stream through a few aligned buffers; every step must be bit for
bit torch.optim.AdamW(fused=True) on the same tensors in memory."""
import errno
import gc
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tiertrain.config import OptimizerConfig
from tiertrain.io import (AlignedBufferPool, AsyncIO, SwapCorruptionError, SwapDirError, SwapSpaceError,
                          TensorSwapper)
from tiertrain.io import aio as aio_mod
from tiertrain.update.nvme import NVMeAdamW, pieces_from_param_groups
from tiertrain.update.nvme import optimizer as nvme_mod
from tiertrain.update.nvme import plan as plan_mod

T = 20  # seconds: every wait in these tests is bounded
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CFG = OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
WD = CFG.weight_decay
# Shards of odd sizes: smaller than a page (1000 floats = 4000 bytes), a single element, an
# empty one; pieces with and without decay, a 0-length piece, pieces starting at odd offsets and
# padding no piece covers.
SIZES = [1000, 1, 0, 5003, 20011, 777]
PIECES = [
    [(0, 300, WD), (300, 300, 0.0), (300, 997, 0.0)],
    [(0, 1, 0.0)],
    [],
    [(3, 2050, WD), (2050, 2051, 0.0), (2051, 5003, WD)],
    [(0, 17, 0.0), (17, 10017, WD), (10017, 10017, WD), (10017, 20000, 0.0)],
    [(0, 777, WD)],
]
LRS = [1e-3, 2.5e-3, 5e-4, 3e-3, 1.7e-3, 4e-4]
CHUNK = 12 * 128                       # 128 elements per chunk: 214 chunks for these shards


def _shards(seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in sizes]


def _grads(step, sizes=SIZES):
    g = torch.Generator().manual_seed(1000 + step)
    scale = [1e-3, 1.0, 30.0][step % 3]
    return [torch.randn(n, generator=g) * scale for n in sizes]


class Reference:
    """torch.optim.AdamW(fused=True) over per-piece views of in-memory shards, as the engine
    builds it (Engine._optimizer_groups)."""

    def __init__(self, shards, pieces=PIECES):
        self.shards = [t.clone() for t in shards]
        self.pieces = pieces
        self.views = [[self.shards[s][a:b] for a, b, _ in ps] for s, ps in enumerate(pieces)]
        decay = [v for s, ps in enumerate(pieces) for v, (_, _, wd) in zip(self.views[s], ps) if wd]
        no_decay = [v for s, ps in enumerate(pieces) for v, (_, _, wd) in zip(self.views[s], ps) if not wd]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=CFG.lr, betas=CFG.betas, eps=CFG.eps, fused=True)

    def step(self, grads, lr):
        for s, ps in enumerate(self.pieces):
            for v, (a, b, _) in zip(self.views[s], ps):
                v.grad = grads[s][a:b]
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()

    def moments(self, s):
        m, v = torch.zeros(SIZES[s]), torch.zeros(SIZES[s])
        for view, (a, b, _) in zip(self.views[s], self.pieces[s]):
            st = self.opt.state.get(view)
            if st:
                m[a:b], v[a:b] = st["exp_avg"], st["exp_avg_sq"]
        return m, v


def _assert_same(opt, ref, outs=None):
    sd = opt.state_dict()
    assert sd["step"] == opt.step_count
    for s in range(len(SIZES)):
        m, v = ref.moments(s)
        d = sd["shards"][s]
        assert torch.equal(d["master"], ref.shards[s]), f"shard {s} master"
        assert torch.equal(d["exp_avg"], m), f"shard {s} exp_avg"
        assert torch.equal(d["exp_avg_sq"], v), f"shard {s} exp_avg_sq"
        if outs is not None:
            assert torch.equal(outs[0][s], ref.shards[s]), f"shard {s} fp32 destination"
            assert torch.equal(outs[1][s], ref.shards[s].to(torch.bfloat16)), f"shard {s} bf16"


@pytest.fixture
def swapper(tmp_path):
    io = AsyncIO(num_threads=4, block_bytes=1 << 20)
    sw = TensorSwapper(tmp_path, io, AlignedBufferPool(1 << 20, 1 << 20, pin=False), rank=0,
                       wait_timeout=T)
    yield sw
    sw.close()
    io.close(T)


# ------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("transactional,num_buffers,threads,elems",
                         [(True, 3, "auto", 128), (False, 5, 2, 512)])
def test_steps_are_bitwise_torch_fused_adamw(swapper, transactional, num_buffers, threads, elems):
    """The reference runs on 1 torch thread (fixture), the optimizer on 1 or 2: the fused
    kernel's result does not depend on the thread count."""
    shards = _shards()
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=12 * elems, num_buffers=num_buffers,
                    transactional=transactional, compute_threads=threads, wait_timeout=T)
    assert opt.chunk_elems == elems and opt.num_chunks > sum(SIZES) // elems
    del shards                                            # the optimizer keeps no RAM copy
    outs = ([torch.full((n,), float("nan")) for n in SIZES],
            [torch.zeros(n, dtype=torch.bfloat16) for n in SIZES])
    for k, lr in enumerate(LRS[:4]):
        grads = _grads(k)
        ref.step(grads, lr)
        stats = opt.step(grads, lr, out=outs[0] if k % 2 == 0 else outs[0][:2] + [None] + outs[0][3:])
        opt.publish(outs[1])
        n = 12 * sum(SIZES)
        assert (stats.bytes_read, stats.bytes_written, stats.chunks) == (n, n, opt.num_chunks)
        assert stats.seconds > 0 and 0.0 <= stats.overlap <= 1.0 and stats.io_seconds > 0
        assert stats.gbps > 0 and stats.compute_seconds > 0
    assert opt.step_count == 4 == int(ref.opt.state[ref.views[0][0]]["step"])
    _assert_same(opt, ref, outs)
    opt.close()
    assert not [k for k in swapper.keys() if str(k).startswith("nvme_adamw.")]
    assert os.listdir(swapper.rank_dir) == [".lock"]      # files deleted


def test_callback_destination_prefetch_and_param_groups(tmp_path):
    shards = _shards(1)
    # pieces derived from param groups of views, as the engine builds its optimizer groups
    views = [[shards[s][a:b] for a, b, _ in ps] for s, ps in enumerate(PIECES)]
    groups = [{"params": [v for s, ps in enumerate(PIECES) for v, p in zip(views[s], ps) if p[2]],
               "weight_decay": WD},
              {"params": [v for s, ps in enumerate(PIECES) for v, p in zip(views[s], ps) if not p[2]],
               "weight_decay": 0.0}]
    pieces = pieces_from_param_groups(shards, groups)
    assert pieces == [[p for p in ps if p[1] > p[0]] for ps in PIECES]
    with pytest.raises(ValueError, match="not a view of any of the shards"):
        pieces_from_param_groups(shards, [{"params": [torch.ones(3)]}])
    ref = Reference(shards)
    with NVMeAdamW(shards, pieces, CFG, swap_dir=tmp_path / "swap", rank=0, chunk_bytes=12 * 4096,
                   num_buffers=4, wait_timeout=T) as opt:
        seen = []
        for k, lr in enumerate(LRS[:3]):
            grads = _grads(k)
            ref.step(grads, lr)
            seen.clear()
            assert opt.prefetch() == opt.num_buffers == 4  # every buffer's read starts early
            opt.step(grads, lr, out=lambda s, a, b, p: seen.append((s, a, b, p.clone())))
        cover = {s: [] for s in range(len(SIZES))}
        for s, a, b, p in seen:
            cover[s].append((a, b))
            assert torch.equal(p, ref.shards[s][a:b])
        for s, n in enumerate(SIZES):
            pos = 0
            for a, b in sorted(cover[s]):
                assert a == pos and b > a
                pos = b
            assert pos == n
        _assert_same(opt, ref)
    assert not os.path.exists(tmp_path / "swap")          # private swapper cleaned up


def test_chunks_cut_pieces_only_at_aligned_offsets():
    """A cut inside a piece falls a multiple of ALIGN_ELEMS after the piece's start, else the
    fused kernel's scalar tail would round elements next to the cut differently."""
    for cap in (64, 128, 640):
        for s, (n, ps) in enumerate(zip(SIZES, PIECES)):
            chunks = plan_mod._plan(s, n, ps, cap)
            assert (chunks[0].lo if chunks else 0) == 0 and (chunks[-1].hi if chunks else 0) == n
            for c, d in zip(chunks, chunks[1:]):
                assert c.hi == d.lo and c.numel <= cap
                for a, b, _ in ps:
                    if a < c.hi < b:
                        assert (c.hi - a) % plan_mod.ALIGN_ELEMS == 0


# ------------------------------------------------------------------------------ memory
def _rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_ram_footprint_is_the_buffers_only(swapper):
    tiny = NVMeAdamW([torch.zeros(1000)], None, CFG, swapper, name="tiny", chunk_bytes=1 << 20,
                     wait_timeout=T)
    small = NVMeAdamW([torch.zeros(300_000)], None, CFG, swapper, name="small",
                      chunk_bytes=1 << 20, wait_timeout=T)
    with pytest.raises(ValueError, match="already holds keys named small"):
        NVMeAdamW([torch.zeros(5)], None, CFG, swapper, name="small", wait_timeout=T)
    assert small.state_dict()["step"] == 0                # the clash left small's files alone
    n = 8 << 20                                           # 8M params: 96 MiB of state
    shard, grad = torch.randn(n), torch.randn(n) * 1e-3
    gc.collect()
    before = _rss()
    big = NVMeAdamW([shard], None, CFG, swapper, name="big", chunk_bytes=1 << 20, wait_timeout=T)
    big.step([grad], 1e-3, out=[shard])
    big.step([grad], 1e-3, out=[shard])
    grown = _rss() - before
    slot = round_up(4 * big.chunk_elems, 4096) + round_up(8 * big.chunk_elems, 4096)  # master, then moments
    assert small.resident_bytes == big.resident_bytes == 4 * slot <= 4 * ((1 << 20) + 4096)   # buffers only
    assert tiny.resident_bytes == 4 * 12288 < small.resident_bytes           # ≤ one chunk each
    assert big.state_bytes == 12 * n and big.disk_bytes >= 2 * 12 * n
    assert grown < big.resident_bytes + (24 << 20), (grown, big.state_bytes)   # ≪ 96 MiB of state
    for opt in (tiny, small, big):
        opt.close()


def round_up(n, m):
    return -(-n // m) * m


# ------------------------------------------------------------------------------ state_dict
def test_state_dict_round_trip_resumes_bit_identically(swapper, tmp_path):
    shards = _shards(2)
    ref = Reference(shards)
    a = NVMeAdamW(shards, PIECES, CFG, swapper, name="a", chunk_bytes=CHUNK, wait_timeout=T)
    for k in range(3):
        grads = _grads(k)
        ref.step(grads, LRS[k])
        a.step(grads, LRS[k])
    sd = a.state_dict()
    # another optimizer, other chunking, other swap location: resumes exactly
    b = NVMeAdamW(_shards(99), PIECES, CFG, swap_dir=tmp_path / "other", rank=0,
                  chunk_bytes=12 * 1000, num_buffers=3, transactional=False, wait_timeout=T)
    b.load_state_dict(sd)
    assert b.step_count == 3
    outs = [torch.zeros(n) for n in SIZES]
    for k in range(3, 5):
        grads = _grads(k)
        ref.step(grads, LRS[k])
        a.step(grads, LRS[k])
        b.step(grads, LRS[k], out=outs)
    _assert_same(a, ref)
    _assert_same(b, ref)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref.shards))
    with pytest.raises(ValueError, match="different pieces"):
        bad = dict(sd, pieces=[[(0, 1000, WD)]] + sd["pieces"][1:])
        b.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"shards\[3\]\['exp_avg'\] is torch.float32 of 5 elements"):
        shards_bad = [dict(d) for d in sd["shards"]]
        shards_bad[3]["exp_avg"] = torch.zeros(5)
        b.load_state_dict(dict(sd, shards=shards_bad))
    a.close()
    b.close()


def test_read_and_write_masters_keep_the_moments(swapper):
    """Parameters edited outside training (Engine.gathered_parameters with a modifier rank) go
    back into the masters on NVMe; the Adam moments and the step count stay."""
    shards = _shards(6)
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=CHUNK, wait_timeout=T)
    _run_steps(opt, ref, range(2))
    masters = opt.read_masters([3, 4])
    assert masters[0] is None and torch.equal(masters[3], ref.shards[3])
    assert torch.equal(masters[4], ref.shards[4])
    with torch.no_grad():
        ref.shards[4].mul_(0.5)                          # the reference's params are views of it
    opt.write_masters([None, None, None, None, ref.shards[4].clone(), None])
    assert opt.step_count == 2
    _run_steps(opt, ref, [2, 3])
    _assert_same(opt, ref)
    opt.close()


# ------------------------------------------------------------------------------ faults
def test_unwritable_swap_dir_names_the_path(tmp_path):
    (tmp_path / "plain").write_bytes(b"")
    bad = tmp_path / "plain" / "swap"
    with pytest.raises(SwapDirError, match=str(bad)) as e:
        NVMeAdamW(_shards(), PIECES, CFG, swap_dir=bad, rank=0, wait_timeout=T)
    assert str(bad) in e.value.path


def test_not_enough_disk_space_fails_at_construction(tmp_path, monkeypatch):
    usage = type(shutil.disk_usage("/"))
    monkeypatch.setattr(nvme_mod.shutil, "disk_usage", lambda p: usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(SwapSpaceError, match=rf"{tmp_path / 'swap' / 'rank0'}: \d+ bytes needed"):
        NVMeAdamW(_shards(), PIECES, CFG, swap_dir=tmp_path / "swap", rank=0, wait_timeout=T)
    assert not os.path.exists(tmp_path / "swap")


def _run_steps(opt, ref, ks, outs=None):
    for k in ks:
        grads = _grads(k)
        ref.step(grads, LRS[k])
        opt.step(grads, LRS[k], out=outs)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_swap_file_fails_the_step_and_changes_nothing(swapper, damage):
    shards = _shards(3)
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=CHUNK, wait_timeout=T)
    outs = [t.clone() for t in shards]
    _run_steps(opt, ref, range(2), outs)
    path = opt.files()[opt.num_chunks // 2]
    if damage == "truncate":
        os.truncate(path, 100)
        match = rf"short read from {path}"
    else:
        with open(path, "r+b") as f:
            f.seek(5)
            c = f.read(1)
            f.seek(5)
            f.write(bytes([c[0] ^ 0x10]))
        match = rf"checksum mismatch in {path}"
    before = [o.clone() for o in outs]
    with pytest.raises(SwapCorruptionError, match=match) as e:
        opt.step(_grads(2), LRS[2], out=outs)
    assert e.value.path == path
    assert "not applied" in "".join(e.value.__notes__) and "restored" in "".join(e.value.__notes__)
    assert opt.step_count == 2
    assert all(torch.equal(o, b) for o, b in zip(outs, before))   # published chunks restored
    with pytest.raises(SwapCorruptionError, match=path):          # fails again, no hang
        opt.step(_grads(2), LRS[2])
    opt.close()


def test_disk_full_mid_step_leaves_the_previous_state_and_can_be_retried(swapper, monkeypatch):
    shards = _shards(4)
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=CHUNK, wait_timeout=T)
    outs = [t.clone() for t in shards]
    _run_steps(opt, ref, range(2), outs)
    real, calls = aio_mod.os.pwritev, [0]

    def full(fd, bufs, off):
        calls[0] += 1
        if calls[0] > 50:                                 # fails after ~50 chunk writes
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, bufs, off)

    monkeypatch.setattr(aio_mod.os, "pwritev", full)
    before = [o.clone() for o in outs]
    with pytest.raises(SwapSpaceError, match=rf"out of swap space writing \d+ bytes to "
                                             rf"{swapper.rank_dir}/.*nvme_adamw.*No space left") as e:
        opt.step(_grads(2), LRS[2], out=outs)
    assert e.value.path.startswith(swapper.rank_dir)
    assert opt.step_count == 2 and all(torch.equal(o, b) for o, b in zip(outs, before))
    monkeypatch.undo()
    _run_steps(opt, ref, [2, 3], outs)                    # retried once there is room again
    _assert_same(opt, ref)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref.shards))
    opt.close()


def test_in_place_mode_refuses_steps_after_a_failure_until_reloaded(swapper):
    shards = _shards(5)
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=CHUNK, transactional=False,
                    wait_timeout=T)
    _run_steps(opt, ref, range(2))
    good = opt.state_dict()
    os.truncate(opt.files()[-1], 0)
    with pytest.raises(SwapCorruptionError, match="short read") as e:
        opt.step(_grads(2), LRS[2])
    assert "partly updated" in "".join(e.value.__notes__)
    with pytest.raises(RuntimeError, match="unusable after a failure"):
        opt.step(_grads(2), LRS[2])
    opt.load_state_dict(good)                             # a checkpoint makes it usable again
    _run_steps(opt, ref, [2])
    _assert_same(opt, ref)
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step(_grads(3), LRS[3])


CHILD = r"""
import json, resource, signal, sys, torch
from tiertrain.config import OptimizerConfig
from tiertrain.update.nvme import NVMeAdamW
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)            # else the kernel kills us on EFBIG
torch.manual_seed(0)
shard, grad = torch.randn(100_000), torch.randn(100_000)
out = {}
opt = NVMeAdamW([shard], None, OptimizerConfig(), swap_dir=sys.argv[1], rank=0,
                chunk_bytes=12 * 8192, wait_timeout=20)
dest = torch.empty_like(shard)
opt.step([grad], 1e-3, out=[dest])
before = dest.clone()
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # the next generation's files cannot grow
try:
    opt.step([grad], 1e-3, out=[dest])
    out["error"] = "no error"
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
    out["notes"] = getattr(e, "__notes__", [])
out["step_count"] = opt.step_count
out["dest_unchanged"] = bool(torch.equal(dest, before)
                             and torch.equal(dest, opt.state_dict()["shards"][0]["master"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
opt.step([grad], 1e-3)
out["after_retry"] = opt.step_count
opt.close()
print("RESULT" + json.dumps(out))
"""


def test_real_file_size_limit_mid_step(tmp_path):
    """A real EFBIG from the kernel (RLIMIT_FSIZE in a child process, as tests/test_swap.py does
    for a full disk): the step fails naming the file, leaves step 1's state, and is retried."""
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "swap")], capture_output=True,
                       text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")][-1][6:])
    assert r["error"].startswith(f"SwapSpaceError: out of swap space writing 32768 bytes to "  # a chunk's master record
                                 f"{tmp_path / 'swap' / 'rank0'}/"), r
    assert "EFBIG" in r["error"] and "not applied" in r["notes"][0], r
    assert r["step_count"] == 1 and r["dest_unchanged"] and r["after_retry"] == 2
