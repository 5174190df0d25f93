"""The checkpoint fuzzer (tests/fuzz_checkpoints.py) on a small budget; CI also runs it for
10,000 cases (.ci/run). Mutated markers, rank files, held-tensor files and safetensors headers,
and links, FIFOs and directories in their place: each read as a resume (the engine's
load_checkpoint) and an export read it; mutated pretrained weight files, read by
load_pretrained into the engine; and mutated torch.distributed.checkpoint and DeepSpeed
checkpoints, read by load_dcp_checkpoint and load_deepspeed_checkpoint."""
from __future__ import annotations

import pytest

from fuzz_checkpoints import fuzz


@pytest.mark.timeout(120)
def test_mutated_checkpoints_end_in_a_named_error_never_a_hang_a_read_outside_or_leaked_bytes(tmp_path):
    findings = fuzz(cases=600, seed=20261126, budget_s=90, root=str(tmp_path))
    assert findings.cases == 600
    assert findings.accepted and findings.refused, "the mutations reach both outcomes"
    assert not findings.failures(), "\n".join(findings.failures()[:20])
