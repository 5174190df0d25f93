"""A fuzzer of the configs users bring: DeepSpeed JSON configs (tests/deepspeed_configs/, as a
dict and as a file's text) translated by ``tiertrain train --deepspeed`` and by the Trainer
integration (``TrainingArguments`` + ``deepspeed=``), tiertrain's own config (a dict, YAML and
TOML files, ``--section.key=value`` overrides), and a Hugging Face ``config.json`` read by the
estimator (``--hf-config``), each with values replaced by others of every JSON type (negative,
huge, NaN, infinite, empty, nested), keys removed or added.

Every case must end in a result or in the library's error naming the bad value (ConfigError;
ValueError for a Hugging Face config), never in another
exception (a raw traceback for the user) or an unbounded computation (each case runs under an
address-space limit, so a value that makes the translation allocate without bound is found
as a MemoryError).

    python tests/fuzz_configs.py --cases 20000 --seed 3     # a longer run than CI's
"""
from __future__ import annotations

import copy
import glob
import json
import os
import random
import resource
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))

VALUES = [None, True, False, 0, 1, -1, 2, 3, 7, 0.5, -0.5, 1e30, float("nan"), float("inf"), -float("inf"),
          2 ** 70, -2 ** 70, "auto", "", "x", "true", "1e-3", "cpu", "nvme", "none", "bf16", "fp16", "all",
          "linear", "cosine", "1f1b", "ring", [], [1], [0.9, 0.99], ["a", "b", "c"], {}, {"a": 1}, {"enabled": True}]
"""What a mutation puts in place of a value (a deep copy of one)."""
SECTION_KEYS = ["enabled", "type", "params", "device", "stage", "lr", "pin_memory", "x"]
MEMORY_LIMIT = 6 << 30
"""The address space a case may add to the process's (bytes): a translation that allocates
beyond it is a finding."""


@dataclass
class Findings:
    cases: int = 0
    accepted: int = 0
    refused: int = 0
    raw: dict = field(default_factory=dict)
    """Where a raw exception came from (its type and the library's last frame) -> one case."""
    seconds: float = 0.0

    def failures(self) -> list[str]:
        return [f"{where}: {case}" for where, case in self.raw.items()]


def _paths(d: dict, prefix: tuple = ()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


def mutated(rng: random.Random, config: dict) -> dict:
    """The config with 1-4 values replaced, keys removed or keys added to a section."""
    config = copy.deepcopy(config)
    for _ in range(rng.randint(1, 4)):
        paths = list(_paths(config))
        if not paths:
            config["x"] = 1
            continue
        *above, last = rng.choice(paths)
        target = config
        for k in above:
            target = target[k]
        op = rng.random()
        if op < 0.7:
            target[last] = copy.deepcopy(rng.choice(VALUES))
        elif op < 0.85:
            del target[last]
        elif isinstance(target[last], dict):
            target[last][rng.choice(SECTION_KEYS)] = copy.deepcopy(rng.choice(VALUES))
    return config


def mutated_text(rng: random.Random, text: str) -> bytes:
    """A config file's text with characters changed, removed, bytes that are no UTF-8, or
    nesting without end."""
    op = rng.random()
    if op < 0.35:
        i = rng.randrange(len(text))
        return (text[:i] + rng.choice('{}[]",:0-eE.\\ xn=#\n\t') + text[i + 1:]).encode()
    if op < 0.6:
        i, j = sorted(rng.randrange(len(text)) for _ in range(2))
        return (text[:i] + text[j:]).encode()
    if op < 0.75:
        i = rng.randrange(len(text))
        return text[:i].encode() + bytes([rng.choice([0x80, 0xff, 0xc3, 0x00])]) + text[i:].encode()
    depth = rng.choice([100, 10_000, 200_000])
    return rng.choice(["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth, "[" * depth,
                       "a:\n" + "".join(" " * i + "- \n" for i in range(0, min(depth, 3000), 2)),
                       "a = " + "[" * depth]).encode()


def _toml(config: dict) -> str:
    """tiertrain's config as TOML (tables of scalars and lists; null values left out)."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in config.items() if v is not None and not isinstance(v, dict)]
    for section, values in config.items():
        if not isinstance(values, dict):
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if v is not None and not isinstance(v, dict)]
    return "\n".join(lines) + "\n"


def _deepspeed_configs() -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(HERE, "deepspeed_configs", "*.json")))]


class _Surfaces:
    """Where a user's config enters: one method per entry point, each returning (what the case
    is, a function that translates it, the error it may raise instead)."""

    def __init__(self, scratch: str):
        from tiertrain.config import to_dict
        from tiertrain.train import TrainConfig

        self.scratch = scratch
        self.deepspeed = _deepspeed_configs()
        self.own = to_dict(TrainConfig())
        self.entries = [self.deepspeed_cli, self.deepspeed_file, self.own_dict, self.own_overrides, self.own_file]
        try:
            import transformers
        except ImportError:
            return
        transformers.logging.set_verbosity_error()  # (its notes on each odd config)
        self.arguments = transformers.TrainingArguments(output_dir=os.path.join(scratch, "out"), report_to="none",
                                                        use_cpu=True)
        small = dict(vocab_size=64, num_attention_heads=4)
        self.hf_configs = [
            transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_key_value_heads=2,
                                     **small).to_dict(),
            transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, **small).to_dict(),
            transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8).to_dict()]
        self.entries += [self.deepspeed_trainer, self.hf_config]

    def deepspeed_cli(self, rng: random.Random):
        """tiertrain train --deepspeed, given the config as a dict."""
        from tiertrain.cli.common import load_with_deepspeed
        from tiertrain.config import ConfigError

        config = mutated(rng, rng.choice(self.deepspeed))
        return config, lambda: load_with_deepspeed(None, [], config), ConfigError

    def deepspeed_trainer(self, rng: random.Random):
        """TrainingArguments with a DeepSpeed config, as TiertrainTrainer translates it."""
        from tiertrain.config import ConfigError
        from tiertrain.integrations.hf_arguments import config_from_training_arguments, deepspeed_schedule

        config = mutated(rng, rng.choice(self.deepspeed))

        def translate():
            config_from_training_arguments(self.arguments, deepspeed=config)
            deepspeed_schedule(config, self.arguments, 100)
        return config, translate, ConfigError

    def deepspeed_file(self, rng: random.Random):
        """tiertrain train --deepspeed FILE, the file's text mutated."""
        from tiertrain.cli.common import load_with_deepspeed
        from tiertrain.config import ConfigError

        path = os.path.join(self.scratch, "ds.json")
        text = mutated_text(rng, json.dumps(rng.choice(self.deepspeed)))
        with open(path, "wb") as f:
            f.write(text)
        return repr(text[:300]), lambda: load_with_deepspeed(None, [], path), ConfigError

    def own_dict(self, rng: random.Random):
        """tiertrain's config as a dict (what a YAML file gives)."""
        from tiertrain.config import ConfigError, from_dict
        from tiertrain.train import TrainConfig

        config = mutated(rng, self.own)
        return config, lambda: from_dict(TrainConfig, config).validate(), ConfigError

    def own_overrides(self, rng: random.Random):
        """--section.key=value overrides of tiertrain's config."""
        from tiertrain.config import ConfigError, from_dict, merge, parse_overrides, to_dict
        from tiertrain.train import TrainConfig

        config = mutated(rng, self.own)
        overrides = []
        for path in _paths(config):
            value = config
            for k in path:
                value = value[k]
            if not isinstance(value, dict) and rng.random() < 0.05:
                overrides.append(f"--{'.'.join(path)}={value}")
        return overrides, lambda: from_dict(TrainConfig, merge(to_dict(TrainConfig()),
                                                               parse_overrides(overrides))).validate(), ConfigError

    def own_file(self, rng: random.Random):
        """tiertrain train --config FILE, a YAML or TOML file's text mutated."""
        import yaml

        from tiertrain.cli.common import load_with_deepspeed
        from tiertrain.config import ConfigError

        path = os.path.join(self.scratch, rng.choice(["c.yaml", "c.toml"]))
        text = yaml.safe_dump(self.own) if path.endswith(".yaml") else _toml(self.own)
        with open(path, "wb") as f:
            f.write(mutated_text(rng, text))
        return path, lambda: load_with_deepspeed(path, [], None), ConfigError

    def hf_config(self, rng: random.Random):
        """tiertrain estimate --hf-config config.json, a few of its values replaced."""
        from tiertrain.estimate.modules import dims_of_hf_config

        config = copy.deepcopy(rng.choice(self.hf_configs))
        for _ in range(rng.randint(1, 2)):
            config[rng.choice(sorted(config))] = copy.deepcopy(rng.choice(VALUES))
        path = os.path.join(self.scratch, "config.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return config, lambda: dims_of_hf_config(path, seq_len=16), ValueError


CASE_S = 10.0
"""Seconds one case may take (each takes milliseconds): a longer one is reported as a hang
(a layer count of 2^70 built modules for hours, and the run ended with no report)."""


class _Hang(BaseException):
    """A case ran past CASE_S (raised by the interval timer: not caught as a refusal)."""


def _hang(*_):
    raise _Hang()


def run_case(rng: random.Random, surfaces: _Surfaces, findings: Findings) -> None:
    what, translate, refusal = rng.choice(surfaces.entries)(rng)
    findings.cases += 1
    # (an outer timer, pytest-timeout's, shares the one SIGALRM: it is set again afterwards)
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.setitimer(signal.ITIMER_REAL, min(CASE_S, outer) if outer else CASE_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            translate()
        findings.accepted += 1
    except refusal:
        findings.refused += 1
    except _Hang:
        findings.raw.setdefault("a hang", f"past {CASE_S:g} s: {json.dumps(what, default=repr)[:400]}")
    except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}tiertrain{os.sep}" in f.filename]
        where = f"{type(e).__name__} at " + (f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
                                             if frames else "the caller")
        findings.raw.setdefault(where, f"{str(e)[:200]!r} from {json.dumps(what, default=repr)[:400]}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))


def fuzz(cases: int, seed: int, budget_s: float) -> Findings:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:  # (the process's address space now, in pages: a pytest run's is large)
        now = int(f.read().split()[0]) * resource.getpagesize()
    limit = now + MEMORY_LIMIT if hard == resource.RLIM_INFINITY else min(now + MEMORY_LIMIT, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        with tempfile.TemporaryDirectory(prefix="tiertrain-fuzz-configs-") as scratch:
            surfaces = _Surfaces(scratch)
            rng = random.Random(seed)
            findings = Findings()
            start = time.monotonic()
            while findings.cases < cases and time.monotonic() - start < budget_s:
                run_case(rng, surfaces, findings)
            findings.seconds = time.monotonic() - start
            return findings
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _summary(f: Findings) -> str:
    return f"{f.accepted} accepted, {f.refused} refused; {len(f.raw)} kinds of raw error"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    from fuzzing import main

    sys.exit(main(__doc__.splitlines()[0], fuzz, _summary))
