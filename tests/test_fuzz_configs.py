"""The config fuzzer (tests/fuzz_configs.py) on a small budget; CI also runs it for 10,000
cases (.ci/run). DeepSpeed configs (as dicts and as files' text) and tiertrain's own (a dict,
YAML and TOML files, --section.key overrides), mutated, each translated where a user's
config enters: every case ends in a config or a ConfigError, never a raw exception."""
from __future__ import annotations

import pytest

from fuzz_configs import fuzz


@pytest.mark.timeout(120)
def test_mutated_configs_end_in_a_config_or_a_named_error():
    findings = fuzz(cases=1500, seed=20261128, budget_s=90)
    assert findings.cases == 1500
    assert findings.accepted and findings.refused, "the mutations reach both outcomes"
    assert not findings.failures(), "\n".join(findings.failures()[:20])
