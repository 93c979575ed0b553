"""llama.cpp's draw samplers in the batched sampler: top-n-sigma, typical-p, XTC, mirostat 1/2.

Which rows: random rows (temperature > 0) whose slot uses one of them (`uses["llama_draw"]`);
greedy requests have them reset to off (sampling_params.py). They take the PyTorch path (the
C++ one draws vLLM's samplers only). The definitions are llama.cpp's (src/llama-sampler.cpp);
the order is vLLM's for vLLM's samplers and llama.cpp's for its own. Per row, on the logits
after every stage before temperature:

  1. temperature: s = logits / T, as everywhere in nanoserve;
  2. top-n-sigma (top_n_sigma > 0): keep s >= max - n * std, max and the population std over
     the finite logits (float64, fixed-order sums). Scaling s scales max and std alike, so the
     kept set is the same at any temperature (up to rounding);
  3. min-p and top-k, exactly as truncation.py defines them (min-p against the max of 2's
     survivors);
  4. typical-p (typical_p < 1): locally typical sampling over the survivors: p their softmax,
     H its entropy, order by |-log p - H| ascending (ties: lowest token id first), keep until
     the running sum of p exceeds typical_p (llama.cpp's `>`; at least one token);
  5. top-p, truncation.py's rule, on the distribution renormalized over 4's survivors;
  6. XTC (xtc_probability > 0, xtc_threshold <= 0.5): a coin u from the row's own seeded
     stream (noise.row_uniforms of (seed, position) with `XTC_SALT`, independent of the
     draw's noise); if u <= xtc_probability and two or more survivors have p >= threshold (p
     the softmax over 5's survivors), all of those are dropped but the least likely one (ties:
     the highest id stays, llama.cpp's last in its order);
  7. the draw: Gumbel-max with noise.py's noise over the survivors, ties to the lowest id
     (truncation.draw_candidates).

Mirostat (1 or 2) replaces all of that, as llama.cpp's chain does (temperature, then
mirostat): temperature scaling, then the mirostat step; top-k, top-p, min-p, typical-p, top-n-
sigma and XTC are ignored. With p the softmax over the whole row:
  - v2 keeps the tokens whose surprise -log2 p is at most mu (the most likely one if none);
  - v1 fits a Zipf exponent s_hat on the best 100 tokens and keeps the top k tokens (ties
    with the k-th kept), k = ((e * 2^mu) / (1 - V^-e))^(1 / s_hat), e = s_hat - 1, V the
    vocabulary size (llama_filters.py has the details);
then draws (Gumbel-max over the kept set: the renormalized distribution) and updates
mu -= eta * (surprise - tau), the surprise -log2 of the drawn token's probability
renormalized over the kept set (llama.cpp's `cur_p->data[idx].p` after its second softmax).
mu starts at 2 * tau per request, is float64 here (llama.cpp: float32), and advances only with
committed tokens. Row j of a draft window draws as a one-token decode after drafts[:j] would:
it starts from the mu after row j - 1's draw (which is that decode's mu whenever row j - 1
drew its draft, the only case where row j counts), so a window's rows are drawn in order of
their offset; after the drafts are checked, the slot keeps the mu after its last committed
row. The engine carries each slot's mu back with the step (StepOutput.mirostat_mu) so a
preempted request resumes with it (SequenceData.mirostat_mu).

Rows that ask for processed logprobs get the post-sampler logits: s, -inf where cut.
Cost: the chain sorts as much of a row as its survivors need; typical-p where min-p and
top-k do not cut (it needs every survivor) sorts the row's values only, for its sums, and its
kept set from the few tokens whose shift is smallest (llama_filters.typical_whole). Mirostat
finds its kept set among the best tokens, widened as needed, and draws the noise of the kept
tokens only. Every shortcut gives the same kept set and token as the plain computation; only
the rows that ask for these samplers pay any of it.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.sample.llama_filters import (
    NEG_INF,
    mirostat_masses,
    mirostat_v1_keep,
    mirostat_v2_keep,
    top_n_sigma,
    top_p_survivors,
    typical,
    typical_whole,
    xtc,
    zipf_exponents,
)
from nanoserve.sample.noise import gumbel_noise, row_uniforms
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.stages import SamplingBatch
from nanoserve.sample.state import SamplingState
from nanoserve.sample.truncation import draw_candidates, truncate

XTC_SALT = 0x5854435F434F494E  # "XTC_COIN": the coin's stream, apart from the draw's noise


class LlamaDrawState:
    """Per-slot parameters of llama.cpp's draw samplers and each mirostat slot's mu.

    Written on admission (`add_request`), read by `draw`; `commit` moves the step's mu to the
    slots once the committed rows are known. Host arrays choose the rows and skip unused
    samplers; the tensors hold what the rows compute with."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(num_slots, dtype=torch.float64, device=device)

        self.device = device
        self.typical_p, self.top_n_sigma = zeros() + 1.0, zeros()
        self.xtc_probability, self.xtc_threshold = zeros(), zeros()
        self.tau, self.eta, self.mu = zeros(), zeros(), zeros()
        self.mirostat = np.zeros(num_slots, dtype=np.int64)  # 0 off, 1, 2
        # which samplers a slot uses (host): a step skips the ones no row uses
        self.uses = {name: np.zeros(num_slots, dtype=bool)
                     for name in ("top_n_sigma", "typical", "top_p", "xtc")}
        # typical-p with no min-p or top-k before it: llama_filters.typical_whole
        self.typical_whole = np.zeros(num_slots, dtype=bool)
        # the step's mirostat rows (batch rows, host) and the mu after each one's draw
        self._rows: np.ndarray | None = None
        self._mu_after = zeros()[:0]

    def add_request(self, seq: SequenceData) -> None:
        """Write the sequence's parameters into its slot; mu from the sequence (after a
        preemption) or 2 * tau."""
        slot, p = seq.slot, seq.params
        llama = p.uses_llama_draw
        self.mirostat[slot] = p.mirostat if llama else 0
        self.uses["top_n_sigma"][slot] = llama and p.top_n_sigma > 0.0
        self.uses["typical"][slot] = llama and p.typical_p < 1.0
        self.typical_whole[slot] = (llama and p.typical_p < 1.0 and p.min_p <= 0.0
                                    and p.top_k <= 0)
        self.uses["top_p"][slot] = llama and p.top_p < 1.0
        self.uses["xtc"][slot] = llama and p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5
        self.typical_p[slot] = p.typical_p
        self.top_n_sigma[slot] = p.top_n_sigma
        self.xtc_probability[slot] = p.xtc_probability
        self.xtc_threshold[slot] = p.xtc_threshold
        self.tau[slot] = p.mirostat_tau
        self.eta[slot] = p.mirostat_eta
        self.mu[slot] = seq.mirostat_mu if seq.mirostat_mu is not None else 2.0 * p.mirostat_tau

    def remove_request(self, slot: int) -> None:
        self.mirostat[slot] = 0
        self.typical_whole[slot] = False
        for flags in self.uses.values():
            flags[slot] = False

    def draw(self, scaled: torch.Tensor, rows: np.ndarray, batch: SamplingBatch,
             state: SamplingState, keys: torch.Tensor, need_final: bool
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's `rows` (host) that use llama.cpp's samplers: scaled [r, V] their
        temperature-scaled logits, keys [r] their noise keys -> (token ids [r], and with
        `need_final` the final logits [r, V]: scaled with -inf where cut; else None). Keeps
        the mirostat rows' new mu for `commit`."""
        slots = batch.slots[rows]
        miro = np.flatnonzero(self.mirostat[slots] > 0)
        chain = np.flatnonzero(self.mirostat[slots] == 0)
        self._rows = rows[miro] if len(miro) else None
        if not len(miro):  # one kind of row (the usual step): no copies in and out
            ids, vals = self._chain(scaled, rows, batch, state)
            return (draw_candidates(ids, vals, keys),
                    _scatter_final(scaled, ids, vals) if need_final else None)
        if not len(chain):
            drawn, final, self._mu_after = self._mirostat(scaled, rows, batch, keys,
                                                          need_final)
            return drawn, final
        drawn = torch.empty(len(rows), dtype=torch.int64, device=scaled.device)
        final = torch.empty_like(scaled) if need_final else None
        at = torch.from_numpy(chain).to(scaled.device)
        part = scaled.index_select(0, at)
        ids, vals = self._chain(part, rows[chain], batch, state)
        drawn[at] = draw_candidates(ids, vals, keys.index_select(0, at))
        if final is not None:
            final[at] = _scatter_final(part, ids, vals)
        at = torch.from_numpy(miro).to(scaled.device)
        drawn[at], final_miro, self._mu_after = self._mirostat(
            scaled.index_select(0, at), rows[miro], batch, keys.index_select(0, at), need_final)
        if final is not None and final_miro is not None:
            final[at] = final_miro
        return drawn, final

    def _chain(self, scaled: torch.Tensor, rows: np.ndarray, batch: SamplingBatch,
               state: SamplingState) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-6 of the module's docstring -> candidates (ids, vals) [r, K], -inf where
        cut."""
        slots = batch.slots[rows]
        slots_gpu = torch.from_numpy(slots).to(scaled.device)
        sigma = np.flatnonzero(self.uses["top_n_sigma"][slots])
        if len(sigma) == len(rows):
            scaled = top_n_sigma(scaled, self.top_n_sigma.index_select(0, slots_gpu))
        elif len(sigma):  # only the rows that use it (top_n_sigma leaves n <= 0 rows alone)
            at = torch.from_numpy(sigma).to(scaled.device)
            scaled = scaled.index_copy(0, at, top_n_sigma(
                scaled.index_select(0, at), self.top_n_sigma.index_select(0, slots_gpu[at])))
        # typical-p on whole rows (no min-p, no top-k): typical_whole, without truncate's sort
        whole = self.typical_whole[slots]
        parts = []
        if whole.any():
            part = np.flatnonzero(whole)
            at = torch.from_numpy(part).to(scaled.device)
            part_slots = slots_gpu.index_select(0, at)
            parts.append((part, *typical_whole(
                scaled if whole.all() else scaled.index_select(0, at),
                self.typical_p.index_select(0, part_slots))))
        if not whole.all():
            part = np.flatnonzero(~whole)
            at = torch.from_numpy(part).to(scaled.device)
            part_slots = slots_gpu.index_select(0, at)
            ids, vals = truncate(scaled if not whole.any() else scaled.index_select(0, at),
                                 state.top_k.index_select(0, part_slots),
                                 torch.ones(len(part), device=scaled.device),  # top-p later
                                 state.log_min_p.index_select(0, part_slots),
                                 max_top_k=int(state.top_k_cpu[slots[part]].max()))
            if self.uses["typical"][slots[part]].any():
                vals = typical(ids, vals, self.typical_p.index_select(0, part_slots))
            parts.append((part, ids, vals))
        ids, vals = parts[0][1:] if len(parts) == 1 else _merge_rows(len(rows), *parts)
        if self.uses["top_p"][slots].any():
            vals = top_p_survivors(vals, state.top_p.index_select(0, slots_gpu))
        if self.uses["xtc"][slots].any():
            at = torch.from_numpy(rows).to(scaled.device)
            coin = row_uniforms(state.seed.index_select(0, slots_gpu),
                                batch.positions.index_select(0, at), XTC_SALT)
            probability = self.xtc_probability.index_select(0, slots_gpu)
            fires = (coin.double() <= probability) & torch.from_numpy(
                self.uses["xtc"][slots]).to(scaled.device)
            vals = xtc(ids, vals, fires, self.xtc_threshold.index_select(0, slots_gpu))
        return ids, vals

    def _mirostat(self, scaled: torch.Tensor, rows: np.ndarray, batch: SamplingBatch,
                  keys: torch.Tensor, need_final: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Mirostat rows -> (token ids [m], final logits [m, V] or None without `need_final`,
        mu after each draw [m]).
        One pass per window offset: row j of a window starts from row j - 1's new mu (the
        rows of a window are consecutive, so that is the previous mirostat row)."""
        device = scaled.device
        slots = batch.slots[rows]
        slots_gpu = torch.from_numpy(slots).to(device)
        is_v1 = torch.from_numpy(self.mirostat[slots] == 1).to(device)
        tau, eta = self.tau.index_select(0, slots_gpu), self.eta.index_select(0, slots_gpu)
        top, weights, log_z = mirostat_masses(scaled)
        zipf = zipf_exponents(scaled) if bool(is_v1.any()) else None
        offsets = (np.zeros(len(rows), dtype=np.int64) if batch.offsets is None
                   else batch.offsets[rows])
        mu = self.mu.index_select(0, slots_gpu)
        mu_after = torch.empty_like(mu)
        drawn = torch.empty(len(rows), dtype=torch.int64, device=device)
        keep = torch.empty_like(scaled, dtype=torch.bool) if need_final else None
        for offset in range(int(offsets.max()) + 1):
            level = np.flatnonzero(offsets == offset)
            index = torch.from_numpy(level).to(device)
            if offset:  # carried from the row before in the window
                mu[index] = mu_after[index - 1]
            # no windows: every row at once, without copies
            at = slice(None) if len(level) == len(rows) else index
            mu_here = mu[at]
            kept = mirostat_v2_keep(scaled[at], top[at], log_z[at], mu_here)
            if zipf is not None:
                s_hat, size = (x[at] for x in zipf)
                kept = torch.where(is_v1[at][:, None], mirostat_v1_keep(
                    scaled[at], s_hat, size, mu_here), kept)
            if keep is not None:
                keep[at] = kept
            # Gumbel-max over the kept tokens only (in id order: the first max, the lowest id)
            ids, inside = _kept_ids(kept)
            scores = scaled[at].gather(1, ids) + gumbel_noise(keys[at], ids)
            tokens = ids.gather(1, scores.masked_fill(~inside, NEG_INF).argmax(dim=-1,
                                                                                keepdim=True))
            drawn[at] = tokens[:, 0]
            # surprise of the drawn token under the distribution renormalized over `kept`
            # (the sum in id order, as over the whole row with zeros where cut)
            kept_mass = weights[at].gather(1, ids).masked_fill(~inside, 0.0).cumsum(
                dim=-1)[:, -1]
            chosen = weights[at].gather(1, tokens)[:, 0]
            surprise = -torch.log2(chosen / kept_mass)
            mu_after[at] = mu_here - eta[at] * (surprise - tau[at])
        final = None if keep is None else scaled.masked_fill(~keep, NEG_INF)
        return drawn, final, mu_after

    def commit(self, batch: SamplingBatch, num_accepted: list[int]) -> dict[int, float]:
        """After the drafts are checked: each mirostat slot takes the mu after its last
        committed row. -> {slot: mu} for the step's output (the one extra device -> host copy,
        only in steps with mirostat rows)."""
        rows, self._rows = self._rows, None
        if rows is None:
            return {}
        if batch.offsets is None or batch.num_sample_rows is None:
            last = np.arange(batch.num_rows)
        else:
            firsts = np.cumsum(batch.num_sample_rows) - batch.num_sample_rows
            last = firsts + np.asarray(num_accepted, dtype=np.int64) - 1
        where = np.full(batch.num_rows, -1)
        where[rows] = np.arange(len(rows))
        last = last[where[last] >= 0]
        slots = batch.slots[last]
        values = self._mu_after.index_select(0, torch.from_numpy(where[last]).to(self.device))
        self.mu[torch.from_numpy(slots).to(self.device)] = values
        return dict(zip(slots.tolist(), values.tolist(), strict=True))


def _merge_rows(rows: int, *parts: tuple[np.ndarray, torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates (ids, vals) of row subsets (host rows, ids, vals) -> one [rows, K], padded
    with id 0 at -inf."""
    width = max(ids.shape[1] for _, ids, _ in parts)
    device = parts[0][1].device
    ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
    vals = torch.full((rows, width), NEG_INF, dtype=parts[0][2].dtype, device=device)
    for at, some_ids, some_vals in parts:
        index = torch.from_numpy(at).to(device)
        ids[index, : some_ids.shape[1]] = some_ids
        vals[index, : some_vals.shape[1]] = some_vals
    return ids, vals


def _kept_ids(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [r, V] -> (each row's kept token ids in ascending order [r, K], padded with id 0;
    which entries are real [r, K]), K the most kept in a row."""
    counts = keep.sum(dim=-1)
    width = max(int(counts.max()), 1)
    row, col = keep.nonzero(as_tuple=True)  # row-major: ascending ids within a row
    starts = counts.cumsum(dim=0) - counts
    ids = torch.zeros(keep.shape[0], width, dtype=torch.int64, device=keep.device)
    ids[row, torch.arange(len(row), device=keep.device) - starts[row]] = col
    inside = torch.arange(width, device=keep.device)[None, :] < counts[:, None]
    return ids, inside


def _scatter_final(scaled: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """The final logits [r, V] of candidates (ids, vals): -inf but at the candidates. amax:
    padding candidates (id 0 at -inf) must not overwrite token 0."""
    return torch.full_like(scaled, NEG_INF).scatter_reduce_(1, ids, vals, "amax")
