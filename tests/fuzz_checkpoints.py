"""A fuzzer of checkpoint and safetensors files (issue 32): random mutations of a committed
checkpoint's marker, rank file and held-tensors file, of a safetensors header, and special files
(links, FIFOs, directories) in their place, each read the way a resume (the engine's own
``load_checkpoint``) and an export read it; the same of a pretrained model directory's
``model.safetensors``, read by ``load_pretrained`` into an engine; and of the other frameworks'
checkpoints an engine reads: a torch.distributed.checkpoint directory (``.metadata`` and its
data file, ``load_dcp_checkpoint``), a DeepSpeed ZeRO checkpoint (``latest``, the model states
and the optimizer files, ``load_deepspeed_checkpoint``) and transformers' Trainer's own
(``model.safetensors``, ``optimizer.pt`` and ``scaler.pt``; under FSDP with FULL_STATE_DICT,
``pytorch_model_fsdp.bin`` and ``optimizer.bin``: tiertrain/state/trainer_checkpoint.py), also
of a run with transformers' Adafactor (state not per element) into an engine stepping it.

Every case must end, within CASE_LIMIT_S, in a result or in the library's own error
(CheckpointError, or ValueError for a pretrained file), never in another exception (a raw
traceback for the user); no file outside the checkpoint may be opened (an audit hook watches
every open of a sentinel directory beside it); and every tensor read from a safetensors file
(exported, or loaded into the engine) must hold bytes that are in the file (none from process
memory).

    python tests/fuzz_checkpoints.py --cases 20000 --seed 3     # a longer run than CI's
"""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_watch = {"root": None, "opened": []}


def _audit(event, args):  # (installed once per process; active while a root is set)
    root = _watch["root"]
    if root is None or event != "open" or not args:
        return
    path = args[0]
    if isinstance(path, int):
        return
    path = os.fsdecode(path)
    if os.path.abspath(path).startswith(root):
        _watch["opened"].append(path)


@dataclass
class Findings:
    cases: int = 0
    accepted: int = 0
    refused: int = 0
    hangs: list = field(default_factory=list)
    raw: list = field(default_factory=list)
    outside: list = field(default_factory=list)
    leaked: list = field(default_factory=list)
    seconds: float = 0.0

    def failures(self) -> list:
        return self.hangs + self.raw + self.outside + self.leaked


class _Hang(BaseException):
    """(Not an Exception: a reader's ``except Exception`` must not turn a hang into a refusal.)"""


def _alarm(signum, frame):
    raise _Hang()


def make_checkpoint(root: str):
    """A committed single-rank checkpoint with a held-tensors file (a model with a buffer), a
    pretrained directory of the same model's weights, and the engine that wrote them (which
    every case restores into)."""
    from safetensors.torch import save_file

    import tiertrain
    from reference import global_batches, make_config, make_model

    cfg = make_config(batch={"micro_batch_size": 2})
    model = make_model()
    model.register_buffer("scale", torch.arange(6, dtype=torch.float32))
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(iter(global_batches(1, 2)))
    directory = os.path.join(root, "ckpt")
    engine.save_checkpoint(directory)
    pretrained = os.path.join(root, "pretrained")
    os.makedirs(pretrained)
    weights = {k: v.detach().clone().contiguous() for k, v in engine.full_state_dict().items()
               if k in dict(engine.module.named_parameters())}
    save_file(weights, os.path.join(pretrained, "model.safetensors"))
    return directory, pretrained, engine


def make_foreign(root: str):
    """A torch.distributed.checkpoint directory of a tiny Llama after one AdamW step (saved in
    one process, as get_state_dict gives it), the same as transformers' Trainer saves it on its
    own (with its one param group's names), a copy of a DeepSpeed ZeRO-2 checkpoint of the same
    model (tests/deepspeed_checkpoints/), and an engine of that model all load into."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import tiertrain
    from deepspeed_models import build_llama
    from reference import make_config

    model = build_llama()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp_dir = os.path.join(root, "dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (dcp.save in one process says it assumes one)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=dcp_dir)
    trainer_dir = os.path.join(root, "trainer")  # (as transformers' Trainer saves checkpoint-N on its own)
    os.makedirs(trainer_dir)
    save_file({n: v.detach().clone().contiguous() for n, v in model.state_dict().items()
               if n != "lm_head.weight"}, os.path.join(trainer_dir, "model.safetensors"))
    torch.save(opt.state_dict(), os.path.join(trainer_dir, "optimizer.pt"))
    torch.save(torch.amp.GradScaler("cpu").state_dict(), os.path.join(trainer_dir, "scaler.pt"))
    groups = [[n for n, p in model.named_parameters() if p.requires_grad]]
    full_dir = os.path.join(root, "fsdpfull")  # (as the Trainer saves it under FSDP with FULL_STATE_DICT)
    os.makedirs(full_dir)
    torch.save(msd, os.path.join(full_dir, "pytorch_model_fsdp.bin"))
    torch.save(osd, os.path.join(full_dir, "optimizer.bin"))
    deepspeed_dir = os.path.join(root, "deepspeed")
    shutil.copytree(os.path.join(HERE, "deepspeed_checkpoints", "z2_bf16_w2"), deepspeed_dir,
                    ignore=shutil.ignore_patterns("expected.pt"))
    cfg = make_config(zero={"stage": 2}, precision={"dtype": "fp32"})
    engine = tiertrain.wrap(build_llama(seed=11), cfg, tiertrain.Topology.build(cfg.parallel))
    # The Trainer's checkpoint of a run with transformers' Adafactor (optim="adafactor"): state that
    # is not per element (row and column factors, a number as its step), into an engine stepping it whole.
    from transformers.optimization import Adafactor

    adafactor = functools.partial(Adafactor, lr=1e-3, scale_parameter=False, relative_step=False)
    model = build_llama()
    opt = adafactor([p for p in model.parameters() if p.requires_grad])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    adafactor_dir = os.path.join(root, "adafactor")
    os.makedirs(adafactor_dir)
    save_file({n: v.detach().clone().contiguous() for n, v in model.state_dict().items()
               if n != "lm_head.weight"}, os.path.join(adafactor_dir, "model.safetensors"))
    torch.save(opt.state_dict(), os.path.join(adafactor_dir, "optimizer.pt"))
    adafactor_engine = tiertrain.wrap(build_llama(seed=11), cfg, tiertrain.Topology.build(cfg.parallel),
                                      optimizer=adafactor)
    return ({"dcp": dcp_dir, "deepspeed": deepspeed_dir, "trainer": (trainer_dir, groups), "fsdpfull": full_dir,
             "adafactor": (adafactor_dir, groups)}, {"adam": engine, "adafactor": adafactor_engine})


# -- mutations ------------------------------------------------------------------------------

NAMES = ["/dev/zero", "../outside/secret", "../../outside/secret", "a/b", "", ".", "..", "x" * 300,
         "rank00000.pt", "COMMITTED.json", "\u00e9", "OUTSIDE_ABS"]
VALUES = [None, -1, 0, 1, 2, 10**12, 2**63, -2**63, 1.5, float("1e308"), "x", "", [], {}, [1, 2], {"a": 1}, True]


def _mutate_json(rng: random.Random, obj, outside: str):
    """One random change somewhere in a JSON value."""
    if isinstance(obj, dict) and obj and rng.random() < 0.8:
        key = rng.choice(list(obj))
        roll = rng.random()
        if roll < 0.2:
            del obj[key]
        elif roll < 0.6:
            obj[key] = _mutate_json(rng, obj[key], outside)
        else:
            obj[key] = rng.choice(VALUES)
        if rng.random() < 0.1:
            name = rng.choice(NAMES).replace("OUTSIDE_ABS", outside)
            obj[name] = rng.choice(VALUES + ["0" * 64])
        return obj
    if isinstance(obj, list) and obj and rng.random() < 0.8:
        roll = rng.random()
        i = rng.randrange(len(obj))
        if roll < 0.3:
            del obj[i]
        elif roll < 0.5:
            obj.append(obj[i])
        else:
            obj[i] = _mutate_json(rng, obj[i], outside)
        return obj
    if isinstance(obj, int) and not isinstance(obj, bool) and rng.random() < 0.7:
        return rng.choice([obj + 1, obj - 1, -obj, obj * 1000, 2**62, -1, 0])
    return rng.choice(VALUES + NAMES[:3])


def _flip_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    roll = rng.random()
    if roll < 0.3 and data:
        del data[rng.randrange(len(data)):]
    elif roll < 0.4:
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    else:
        for _ in range(rng.randrange(1, 8)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def _rewrite_marker(step_dir: str, change) -> None:
    from tiertrain.state.checkpoint import MARKER

    path = os.path.join(step_dir, MARKER)
    with open(path) as f:
        marker = json.load(f)
    marker = change(marker)
    with open(path, "w") as f:
        f.write(marker if isinstance(marker, str) else json.dumps(marker))


def _recommit(step_dir: str, name: str) -> None:
    """Recompute name's checksum in the marker, as the producer of a hostile file would."""
    from tiertrain.io.fileio import file_sha256

    def change(marker):
        digest = file_sha256(os.path.join(step_dir, name))
        if name.startswith("rank"):
            marker["sha256"][0] = digest
        else:
            marker["files"][name] = digest
        return marker
    _rewrite_marker(step_dir, change)


def _safetensors_mutation(rng: random.Random, data: bytes) -> bytes:
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    body = data[8 + length:]
    roll = rng.random()
    if roll < 0.6:
        header = _mutate_json(rng, header, "/")
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + body
    if roll < 0.8:
        return struct.pack("<Q", rng.choice([0, 1, length + 1, length * 1000, 2**63 - 1])) + data[8:]
    return _flip_bytes(rng, data)


# -- one case -------------------------------------------------------------------------------

def _read_like_a_resume_and_an_export(directory: str, out: str, engine):
    from tiertrain.state.checkpoint import agree_on_checkpoint, load_rank_file, rank_file_name, verified_file
    from tiertrain.state.consolidate import export_checkpoint

    class One:
        rank, world_size = 0, 1

        @staticmethod
        def world_group():
            return None
    step_dir, marker = agree_on_checkpoint(directory, None, One())
    load_rank_file(verified_file(step_dir, rank_file_name(0), marker["sha256"][0]), torch.device("cpu"))
    export_checkpoint(directory, out)
    engine.load_checkpoint(directory)


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _check_loaded_bytes(engine, sources: list[bytes], findings: Findings, what: str,
                        trained_only: bool = False) -> None:
    """Every parameter a load accepted holds bytes of the files (one rank, fp32: each is copied
    as read; trained_only: the trained ones, the frozen ones having been cast from bf16)."""
    params = dict(engine.module.named_parameters())
    for name, t in engine.full_state_dict().items():
        raw = _raw(t)
        if name in params and (params[name].requires_grad or not trained_only) and raw \
                and not any(raw in s for s in sources):
            findings.leaked.append(f"{what}: loaded {name!r} holds bytes that are in no input file")


def _check_deepspeed_bytes(engine, directory: str, sources: list[bytes], findings: Findings, what: str) -> None:
    """Every trained parameter loaded from a DeepSpeed checkpoint holds, piece by piece (a
    parameter may lie across two ranks' partitions), bytes of the files."""
    from tiertrain.state.deepspeed_files import DeepSpeedCheckpoint

    where = DeepSpeedCheckpoint(directory)._where
    for name, t in engine.full_state_dict().items():
        for rank, offset, lo, hi in where.get(name, ()):
            raw = _raw(t.reshape(-1)[lo:hi])
            if raw and not any(raw in s for s in sources):
                findings.leaked.append(f"{what}: loaded {name!r}[{lo}:{hi}] holds bytes that are in no input file")


def _check_exported_bytes(out: str, sources: list[bytes], findings: Findings, what: str) -> None:
    from safetensors import safe_open

    for name in os.listdir(out):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(out, name), framework="pt") as f:
            for key in f.keys():
                raw = _raw(f.get_tensor(key))
                # (one rank, fp32: every exported tensor is written as it was read, so its bytes
                # are in an input file: a rank file's masters, or the held tensors)
                if raw and not any(raw in s for s in sources):
                    findings.leaked.append(f"{what}: exported {key!r} holds bytes that are in no input file")


def _replace_with_special_file(rng: random.Random, path: str, scratch: str, outside: str) -> None:
    """path becomes a link to /dev/zero, out of the directory or to nothing, a FIFO or a directory."""
    os.remove(path)
    special = rng.choice(["zero", "fifo", "dir", "outside", "dangling"])
    if special == "zero":
        os.symlink("/dev/zero", path)
    elif special == "fifo":
        os.mkfifo(path)
    elif special == "dir":
        os.mkdir(path)
    elif special == "outside":
        os.symlink(os.path.join(outside, "secret"), path)
    else:
        os.symlink(os.path.join(scratch, "missing"), path)


def _pretrained_case(rng: random.Random, pristine: str, scratch: str, outside: str, kind: str) -> None:
    """A mutated copy of the pretrained directory at scratch."""
    shutil.copytree(pristine, scratch)
    path = os.path.join(scratch, "model.safetensors")
    if kind == "pretrained-special":
        _replace_with_special_file(rng, path, scratch, outside)
        return
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(_safetensors_mutation(rng, data) if kind == "pretrained-header" else _flip_bytes(rng, data))


def _checkpoint_case(rng: random.Random, step_dir: str, scratch: str, outside: str, kind: str) -> None:
    """One mutation of the checkpoint copied to scratch (its step directory step_dir)."""
    if kind == "marker":
        _rewrite_marker(step_dir, lambda m: _mutate_json(rng, m, outside))
    elif kind == "marker-text":
        _rewrite_marker(step_dir, lambda m: _flip_bytes(rng, json.dumps(m).encode()).decode("latin-1"))
    elif kind == "rank":
        path = os.path.join(step_dir, "rank00000.pt")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(_flip_bytes(rng, data))
        if rng.random() < 0.7:
            _recommit(step_dir, "rank00000.pt")
    elif kind in ("held", "held-header"):
        path = os.path.join(step_dir, "held_tensors.safetensors")
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(_safetensors_mutation(rng, data) if kind == "held-header" else _flip_bytes(rng, data))
        if rng.random() < 0.8:
            _recommit(step_dir, "held_tensors.safetensors")
    elif kind == "special":
        name = rng.choice(["rank00000.pt", "COMMITTED.json", "held_tensors.safetensors", "export.json"])
        _replace_with_special_file(rng, os.path.join(step_dir, name), scratch, outside)


def _foreign_case(rng: random.Random, pristine: str, scratch: str, outside: str, kind: str) -> str:
    """A mutated copy of the DCP or DeepSpeed checkpoint at scratch; returns the directory whose
    files the engine reads."""
    shutil.copytree(pristine, scratch)
    if kind.startswith("dcp"):
        files = {"dcp-metadata": [".metadata"], "dcp-data": [n for n in os.listdir(scratch) if n != ".metadata"]}
        names, where = files.get(kind, [".metadata", "__0_0.distcp"]), scratch
    elif kind.startswith(("trainer", "adafactor")):
        names, where = [n for n in ["model.safetensors", "optimizer.pt", "scaler.pt"] if os.path.exists(
            os.path.join(scratch, n))], scratch
    elif kind.startswith("fsdpfull"):
        names, where = ["pytorch_model_fsdp.bin", "optimizer.bin"], scratch
    else:
        where = os.path.join(scratch, "global_step3")
        if kind == "deepspeed-latest":
            with open(os.path.join(scratch, "latest"), "w") as f:
                f.write(rng.choice(NAMES + ["global_step3", "global_step3\n", "global_step4"]))
            return where
        names = sorted(os.listdir(where))
    path = os.path.join(where, rng.choice(names))
    if kind.endswith("special"):
        _replace_with_special_file(rng, path, scratch, outside)
        return where
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(_flip_bytes(rng, data))
    return where


CASE_LIMIT_S = 5.0
"""A case that has not ended by then is a hang. The slowest of 2 000 cases measured 0.74 s on a
2-vCPU EPYC (median 3 ms): a 1 s limit failed a case once under CI's load, while a hang, what the
limit is for, never ends."""


def run_case(rng: random.Random, pristine, scratch: str, outside: str, findings: Findings) -> None:
    from tiertrain.errors import said
    from tiertrain.state.checkpoint import CheckpointError
    from tiertrain.state.pretrained import load_pretrained

    from tiertrain.state import trainer_checkpoint

    (directory, pretrained, engine), (foreign, engines) = pristine
    llama = engines["adam"]
    shutil.rmtree(scratch, ignore_errors=True)
    out = scratch + "-out"
    shutil.rmtree(out, ignore_errors=True)
    kind = rng.choice(["marker", "marker-text", "rank", "held", "held-header", "special",
                       "pretrained", "pretrained-header", "pretrained-special", "dcp-metadata", "dcp-data",
                       "dcp-special", "deepspeed-files", "deepspeed-latest", "deepspeed-special", "trainer-files",
                       "trainer-special", "fsdpfull-files", "fsdpfull-special", "adafactor-files",
                       "adafactor-special"])
    framework = kind.split("-")[0]
    if framework in foreign:
        groups = foreign["trainer"][1]
        source = foreign[framework][0] if framework in ("trainer", "adafactor") else foreign[framework]
        step_dir = _foreign_case(rng, source, scratch, outside, kind)
        if framework == "adafactor":
            llama = engines["adafactor"]
        read = {"dcp": lambda: llama.load_dcp_checkpoint(scratch),
                "deepspeed": lambda: llama.load_deepspeed_checkpoint(scratch),
                "trainer": lambda: trainer_checkpoint.load(llama, scratch, groups, 1),
                "fsdpfull": lambda: trainer_checkpoint.load(llama, scratch, groups, 1),
                "adafactor": lambda: trainer_checkpoint.load(llama, scratch, groups, 1)}[framework]
        refusal = CheckpointError
    elif kind.startswith("pretrained"):
        _pretrained_case(rng, pretrained, scratch, outside, kind)
        read, refusal, step_dir = (lambda: load_pretrained(engine, scratch)), ValueError, scratch
    else:
        shutil.copytree(directory, scratch)
        step_dir = os.path.join(scratch, sorted(n for n in os.listdir(scratch) if n.startswith("step_"))[0])
        _checkpoint_case(rng, step_dir, scratch, outside, kind)
        read, refusal = (lambda: _read_like_a_resume_and_an_export(scratch, out, engine)), CheckpointError
    inputs = []
    for name in os.listdir(step_dir):
        p = os.path.join(step_dir, name)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, "rb") as f:
                inputs.append(f.read())
    what = f"case {findings.cases} ({kind})"
    _watch["root"], _watch["opened"] = outside, []
    signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
    try:
        read()
        findings.accepted += 1
        if kind.startswith("pretrained"):
            _check_loaded_bytes(engine, inputs, findings, what)
        elif kind.startswith(("dcp", "trainer", "fsdpfull", "adafactor")):
            _check_loaded_bytes(llama, inputs, findings, what, trained_only=True)
        elif kind.startswith("deepspeed"):
            _check_deepspeed_bytes(llama, scratch, inputs, findings, what)
        else:
            _check_exported_bytes(out, inputs, findings, what)
    except _Hang:
        findings.hangs.append(f"{what}: no result within {CASE_LIMIT_S:g} s")
    except refusal:
        findings.refused += 1
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        findings.raw.append(f"{what}: {said(e)}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _watch["root"] = None
    if _watch["opened"]:
        findings.outside.append(f"{what}: opened {_watch['opened'][:3]}")
    findings.cases += 1


def _warm_up(pristine, scratch: str) -> None:
    """Read the unmutated checkpoint once, untimed, as a case does: a first export imports
    transformers to rebuild the run's model on the meta device (about a second), which the
    CASE_LIMIT_S bound of a case is not about (it catches hangs on mutated input)."""
    (directory, _, engine), _ = pristine
    shutil.copytree(directory, scratch)
    _read_like_a_resume_and_an_export(scratch, scratch + "-out", engine)
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(scratch + "-out", ignore_errors=True)


def fuzz(cases: int, seed: int, budget_s: float, root: str | None = None) -> Findings:
    if not getattr(fuzz, "hooked", False):
        sys.addaudithook(_audit)
        fuzz.hooked = True
    signal.signal(signal.SIGALRM, _alarm)
    own = root is None
    root = root or tempfile.mkdtemp(prefix="tiertrain-fuzz-")
    try:
        outside = os.path.join(root, "outside")
        os.makedirs(outside, exist_ok=True)
        with open(os.path.join(outside, "secret"), "w") as f:
            f.write("{}")
        pristine = make_checkpoint(root), make_foreign(root)  # (checkpoint, pretrained, engine), (dcp, ...)
        _warm_up(pristine, os.path.join(root, "warm-up"))
        rng = random.Random(seed)
        findings = Findings()
        start = time.monotonic()
        while findings.cases < cases and time.monotonic() - start < budget_s:
            run_case(rng, pristine, os.path.join(root, "scratch"), os.path.realpath(outside), findings)
        findings.seconds = time.monotonic() - start
        return findings
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


def _summary(f: Findings) -> str:
    return (f"{f.accepted} accepted, {f.refused} refused; {len(f.hangs)} hangs, {len(f.raw)} raw errors, "
            f"{len(f.outside)} reads outside, {len(f.leaked)} leaks")


if __name__ == "__main__":
    from fuzzing import main

    sys.exit(main(__doc__.splitlines()[0], fuzz, _summary))
