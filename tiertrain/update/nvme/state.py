"""The NVMe optimizer's whole state in and out of the stream: gathered from NVMe into CPU
tensors for a checkpoint (:meth:`OptimizerState.state_dict`) and written back
(``load_state_dict``: as the other generation when transactional, so a failed load leaves the
old state), and the fp32 masters alone read or replaced (a full state dict, parameters edited
outside training), their Adam moments kept.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = ["OptimizerState"]


class OptimizerState:
    """The state part of :class:`~tiertrain.update.nvme.optimizer.NVMeAdamW` (a base class of
    it, working on its attributes and pipeline)."""

    def state_dict(self) -> dict:
        """The whole state gathered from NVMe into new CPU tensors: ``step``, ``state_names``
        (what the slots hold, by the torch optimizer's names: the rule's state_names),
        ``skipped``, ``pieces`` and per shard ``{"master", "exp_avg", "exp_avg_sq"}`` (fp32,
        shard-sized; the rule's state slots under AdamW's names)."""
        self._check_usable()
        shards = [{k: torch.empty(n, dtype=torch.float32) for k in ("master", "exp_avg", "exp_avg_sq")}
                  for n in self._shard_numels]

        def work(j, ch, p, m, v, stats):
            d = shards[ch.shard]
            d["master"][ch.lo:ch.hi].copy_(p)
            d["exp_avg"][ch.lo:ch.hi].copy_(m)
            d["exp_avg_sq"][ch.lo:ch.hi].copy_(v)
        self._stream("state_dict", work, read=True, write=False)
        return {"step": self.step_count, "state_names": list(self.rule.state_names), "skipped": [list(c) for c in self.skipped],
                "pieces": [list(p) for p in self.pieces], "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Write ``state`` (from :meth:`state_dict`, possibly of another NVMeAdamW with the same
        shard sizes and pieces but any chunk size) to NVMe. Transactional: written as the other
        generation and committed at the end, so a failed load leaves the previous state. Clears
        the unusable mark a failed non-transactional step leaves."""
        if self._closed:
            raise RuntimeError(f"NVMeAdamW({self.name}) is closed")
        shards = state["shards"]
        if len(shards) != self.num_shards:
            raise ValueError(f"state has {len(shards)} shards, this optimizer {self.num_shards}")
        for s, (d, n) in enumerate(zip(shards, self._shard_numels)):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                t = d[key]
                if t.numel() != n or t.dtype != torch.float32:
                    raise ValueError(f"state shards[{s}][{key!r}] is {t.dtype} of {t.numel()} "
                                     f"elements; expected fp32 of {n}")
        if "pieces" in state and [[tuple(x) for x in p] for p in state["pieces"]] != \
                [list(p) for p in self.pieces]:
            raise ValueError("state was saved with different pieces (parameter ranges or weight "
                             "decay) than this optimizer's")
        flat = [{k: d[k].detach().reshape(-1) for k in ("master", "exp_avg", "exp_avg_sq")}
                for d in shards]

        def fill(j, ch, p, m, v, stats):
            d = flat[ch.shard]
            p.copy_(d["master"][ch.lo:ch.hi])
            m.copy_(d["exp_avg"][ch.lo:ch.hi])
            v.copy_(d["exp_avg_sq"][ch.lo:ch.hi])
        try:
            new_gens = self._stream("load_state_dict", fill, read=False, write=True)[1]
        except BaseException as e:
            if self.transactional and self._broken is None:
                e.add_note(f"NVMeAdamW({self.name}).load_state_dict failed; the previous state "
                           f"(step {self.step_count}) is unchanged")
            else:
                self._broken = f"load_state_dict failed with {type(e).__name__}: {e}"
                e.add_note(f"NVMeAdamW({self.name}) state is inconsistent; load a state again")
            raise
        self._commit(new_gens)
        self.step_count = int(state["step"])
        self.skipped = [list(c) for c in state.get("skipped", [[0] * len(p) for p in self.pieces])]
        self._broken = None

    def read_masters(self, shards: Optional[Sequence[int]] = None) -> List[Optional[torch.Tensor]]:
        """The fp32 master values of ``shards`` (default: all) as new CPU tensors (None for the
        others), e.g. for a full state dict. Reads only those shards' master records."""
        self._check_usable()
        wanted = set(range(self.num_shards) if shards is None else shards)
        out: List[Optional[torch.Tensor]] = [torch.empty(n, dtype=torch.float32) if s in wanted else None
                                             for s, n in enumerate(self._shard_numels)]
        for s in sorted(wanted):
            self.read_master(s, out[s]).wait(self.wait_timeout)
        return out

    def write_masters(self, masters: Sequence[Optional[torch.Tensor]]) -> None:
        """Replace the master values of the shards given (one tensor of the shard's size, any
        dtype, or None to keep a shard) and keep their Adam moments — e.g. after parameters were
        edited outside training (Engine.gathered_parameters with a modifier rank). Atomic per
        call when transactional, like a step."""
        self._check_usable()
        if len(masters) != self.num_shards:
            raise ValueError(f"{len(masters)} master tensors for {self.num_shards} shards")
        src = self._check_out(masters)
        wanted = {s for s, t in enumerate(src) if t is not None}

        def work(j, ch, p, m, v, stats):
            p.copy_(src[ch.shard][ch.lo:ch.hi])
        try:
            new_gens = self._stream("write_masters", work, positions=self._positions(wanted),
                                    read=True, write=True)[1]
        except BaseException as e:
            if not self.transactional:
                self._broken = f"write_masters failed with {type(e).__name__}: {e}"
            raise
        self._commit(new_gens)
