"""The model's own MTP head as a draft proposer, the worker's side (`--speculative-config
'{"method": "mtp"}'`): after each step's forward and draw it proposes each sampling request's
next `num_drafts` tokens, which go back with the step's output; the core hands them to the
next verify step as it does n-gram drafts (engine/drafts.py), so the output never depends on
them (docs/speculation.md).

How the head is fed, as vLLM feeds it (model/mtp.py has the formula): its row at position i
reads the target's final normed hidden state at i and the token at i + 1, and writes its own
layer's keys and values at i. So a step's rows are its committed positions shifted by one: a
prefill chunk's rows but its last (whose next token is the next chunk's first: that row waits,
`pending`, and leads the next step's rows), and a sampling request's rows up to its last
committed position, whose next token is the one just drawn. A verify chunk's rejected rows are
skipped; whatever the head's cache held there is rewritten before it is read again. The head's
output at the last row gives draft 1 (argmax); drafts 2..k chain, each row reading the draft
before it and the head's own output before it, one position further.

The head's layer has its own paged KV tensors over the same block ids and block tables as the
target's (counted in the cache's block bytes: model_runner.py's `kv_bytes_per_block`), plus a
few scratch blocks per slot: the chain's positions past a request's blocks write there, since
the scheduler gives blocks only to the positions a step computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanoserve.model.attention import cache_row_elements, select_attention_backend
from nanoserve.model.forward_plan import ForwardPlan
from nanoserve.model.fused_ops import Matmul
from nanoserve.model.layer_ops import EXACT_OPS, OpTable, StepContext, fused_table
from nanoserve.model.llama import BoundDecoderLayer, CausalLM
from nanoserve.model.mtp import MtpHead
from nanoserve.protocol import StepInput


@dataclass
class _Rows:
    """A batch of the head's rows, requests in batch order (single rows first)."""

    token_ids: np.ndarray | torch.Tensor  # [M] int64, the token after each row's position
    hidden: torch.Tensor  # [M, hidden], the target's (or the head's own) state at it
    positions: np.ndarray  # [M] int64
    query_start_loc: np.ndarray  # [N + 1] int64
    block_table: np.ndarray  # [N, max_blocks] int32
    num_decodes: int


class MtpDrafter:
    """Runs the MTP head after each step (see the module); one per rank-0 worker."""

    def __init__(self, model: CausalLM, head: MtpHead, plan: ForwardPlan, *, num_blocks: int,
                 block_size: int, num_slots: int, num_drafts: int, cache_dtype: torch.dtype,
                 device: torch.device) -> None:
        arch = model.arch
        assert arch.linear is not None, "the MTP drafter keys a request by its state slot"
        self.model, self.head, self.plan = model, head, plan
        self.block_size, self.num_blocks, self.num_drafts = block_size, num_blocks, num_drafts
        # the chain writes up to num_drafts - 1 positions past a request's blocks
        self.scratch_per_slot = -(-num_drafts // block_size) + 1
        total = num_blocks + num_slots * self.scratch_per_slot
        shape = (arch.num_kv_heads, total, block_size, cache_row_elements(arch.head_dim,
                                                                          cache_dtype))
        self.k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
        self.attention = select_attention_backend(device, cache_dtype, block_size=block_size,
                                                  num_kv_heads=arch.num_kv_heads,
                                                  num_blocks=total)
        self.device = device
        # slot -> (position, the target's hidden state there): a chunk's last row, waiting
        # for the next chunk's first token
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}
        self._bound: dict[bool, tuple[OpTable, BoundDecoderLayer, Matmul]] = {}

    def propose(self, step: StepInput, hidden: torch.Tensor, sampled_token_ids: list[int],
                num_accepted: list[int]) -> list[list[int]]:
        """Each sampling request's `num_drafts` drafts (in `num_sample_rows` order), after the
        step's forward (`hidden`: its final normed states [T, hidden]) and its draw."""
        for slot in step.released_slots:
            self.pending.pop(slot, None)
        for new in step.new_sequences:
            self.pending.pop(new.slot, None)
        rows, last_rows, requests = self._first_rows(step, hidden, sampled_token_ids,
                                                     num_accepted)
        if not len(rows.token_ids):
            return []
        out = self._run(rows)  # [M, hidden]
        if not last_rows:
            return []
        index = torch.tensor(last_rows, device=out.device)
        state = out.index_select(0, index)  # [N, hidden]
        draft = self.model.compute_logits(state).argmax(dim=-1)  # [N]
        drafts = [draft]
        positions = rows.positions[last_rows]  # each request's last committed position
        for j in range(1, self.num_drafts):
            chain = self._chain_rows(step, requests, positions + j, draft, state)
            state = self._run(chain)
            draft = self.model.compute_logits(state).argmax(dim=-1)
            drafts.append(draft)
        # the one copy back to the host
        return torch.stack(drafts, dim=1).tolist()

    def _first_rows(self, step: StepInput, hidden: torch.Tensor, sampled: list[int],
                    num_accepted: list[int]) -> tuple[_Rows, list[int], list[int]]:
        """The step's rows shifted by one (see the module); then, per sampling request in
        `num_sample_rows` order, the batch row of its last committed position and its
        request's index in the step."""
        starts, tokens, positions = step.query_start_loc, step.token_ids, step.positions
        # each sampling request's first sampled row (flat) and index into `sampled`
        first_sampled = np.cumsum(step.num_sample_rows) - step.num_sample_rows
        first_rows = step.logits_rows[first_sampled]
        owners = (np.searchsorted(starts, first_rows, side="right") - 1).tolist()
        commits = {r: (int(row) + taken - 1, int(s) + taken - 1) for r, row, s, taken
                   in zip(owners, first_rows, first_sampled, num_accepted, strict=True)}
        pieces: list[tuple[int, list[int], list[torch.Tensor], int]] = []
        for r in range(step.num_requests):
            q0, q1 = int(starts[r]), int(starts[r + 1])
            slot, start = step.seq_slots[r], int(positions[q0])
            ids: list[int] = []
            states: list[torch.Tensor] = []
            first = start
            waiting = self.pending.pop(slot, None)
            if waiting is not None and waiting[0] == start - 1:  # the last chunk's last row
                first = start - 1
                ids.append(int(tokens[q0]))
                states.append(waiting[1])
            commit = commits.get(r)
            if commit is None:  # a chunk: its last row waits for the next chunk's first token
                end = q1 - 1
                self.pending[slot] = (int(positions[end]), hidden[end : end + 1].clone())
                ids.extend(tokens[q0 + 1 : q1].tolist())
                states.append(hidden[q0:end])
            else:  # up to the last committed position, then the token just drawn
                end = commit[0]
                ids.extend(tokens[q0 + 1 : end + 1].tolist())
                ids.append(sampled[commit[1]])
                states.append(hidden[q0 : end + 1])
            if ids:
                pieces.append((r, ids, states, first))
        pieces.sort(key=lambda p: len(p[1]) > 1)  # single rows first (the backends' order)
        counts = np.array([len(p[1]) for p in pieces], dtype=np.int64)
        query_start_loc = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start_loc[1:])
        last_row = {p[0]: int(query_start_loc[i + 1]) - 1 for i, p in enumerate(pieces)}
        rows = _Rows(
            np.array([t for p in pieces for t in p[1]], dtype=np.int64),
            torch.cat([s for p in pieces for s in p[2]]) if pieces else hidden[:0],
            np.concatenate([np.arange(p[3], p[3] + len(p[1])) for p in pieces])
            if pieces else np.zeros(0, np.int64),
            query_start_loc, step.block_table[[p[0] for p in pieces]],
            int(np.sum(counts == 1)))
        return rows, [last_row[r] for r in owners], owners

    def _chain_rows(self, step: StepInput, requests: list[int], positions: np.ndarray,
                    draft: torch.Tensor, state: torch.Tensor) -> _Rows:
        """One row per drafting request at `positions` (the draft before it, the head's
        output before it); positions past the request's blocks in its slot's scratch blocks."""
        bs = self.block_size
        width = int(positions.max()) // bs + 1
        table = np.zeros((len(requests), width), dtype=np.int32)
        for i, r in enumerate(requests):
            owned = min(width, -(-int(step.context_lens[r]) // bs))
            table[i, :owned] = step.block_table[r, :owned]
            scratch = (self.num_blocks + step.seq_slots[r] * self.scratch_per_slot
                       + np.arange(width - owned))
            table[i, owned:] = np.minimum(scratch, self.num_blocks
                                          + (step.seq_slots[r] + 1) * self.scratch_per_slot - 1)
        return _Rows(draft, state, positions,
                     np.arange(len(requests) + 1, dtype=np.int64), table, len(requests))

    def _run(self, rows: _Rows) -> torch.Tensor:
        """The head over `rows`: its output [M, hidden] (after its final norm), its layer's
        keys and values written at the rows' positions."""
        table, layer, fc = self._layer()
        head, eps, bs = self.head, self.model.arch.rms_norm_eps, self.block_size
        positions = rows.positions
        request_of_row = np.repeat(np.arange(len(rows.block_table)),
                                   np.diff(rows.query_start_loc))
        blocks = rows.block_table[request_of_row, positions // bs].astype(np.int64)
        cache_index = blocks * bs + positions % bs
        step = StepInput(
            token_ids=np.zeros(0, np.int64), positions=positions, cache_index=cache_index,
            query_start_loc=rows.query_start_loc,
            context_lens=(positions[rows.query_start_loc[1:] - 1] + 1).astype(np.int32),
            block_table=rows.block_table, num_decodes=rows.num_decodes,
            logits_rows=np.zeros(0, np.int64), sample_slots=np.zeros(0, np.int64),
            sample_positions=np.zeros(0, np.int64), draft_token_ids=np.zeros(0, np.int64),
            num_sample_rows=np.zeros(0, np.int64), grammar_rows=np.zeros(0, np.int64),
            grammar_bitmask=np.zeros((0, 0), np.int32), prompt_logprobs=[],
            new_sequences=[], released_slots=[])
        meta = self.attention.build_metadata(step)
        positions_t = torch.from_numpy(positions).to(self.device)
        token_ids = (rows.token_ids if isinstance(rows.token_ids, torch.Tensor)
                     else torch.from_numpy(rows.token_ids).to(self.device))
        assert self.model.rotary is not None, "weights loaded"
        cos, sin = table.rope_tables(self.model.rotary, positions_t)
        # x = fc([norm(embedding of the next token) ; norm(the state at this position)])
        x = fc(torch.cat([table.rms_norm(self.model.embed(token_ids),
                                         head.pre_fc_norm_embedding, eps),
                          table.rms_norm(rows.hidden.contiguous(), head.pre_fc_norm_hidden,
                                         eps)], dim=-1))
        context = StepContext(positions_t, cos, sin, self.attention.forward, meta,
                              meta.cache_index, meta.reads_new_kv, eps)
        delta = layer.forward(x, None, context, self.k_cache, self.v_cache)
        return table.add_rms_norm(x, delta, head.norm, eps)

    def _layer(self) -> tuple[OpTable, BoundDecoderLayer, Matmul]:
        """The head's layer and fc bound to the op table the target's forward runs on."""
        is_fused = bool(self.plan.use_fused_ops)
        bound = self._bound.get(is_fused)
        if bound is None:
            table = fused_table() if is_fused else EXACT_OPS
            layer = self.head.layer.bind(table, self.model.group,
                                         self.model.arch.attention_layers[-1], 0)
            bound = self._bound[is_fused] = (table, layer, table.bind_matmul(self.head.fc))
        return bound
