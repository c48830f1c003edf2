"""Packed sequences in captured code (``pack_padded_sequence`` into ``nn.LSTM`` / ``GRU`` / ``RNN``).

Note [packed sequences in a captured graph]
    ``pack_padded_sequence(x, lengths)`` keeps only each sequence's first ``lengths[b]`` steps,
    time-major, sequences sorted longest first: ``sum(lengths)`` rows and ``batch_sizes[t]``
    (how many sequences are still running at step ``t``), both known only from the lengths'
    values. A popxl graph has static shapes, so while torch code is captured ``PackedRNN``
    (a torch-function mode) keeps a packed batch as all ``T x B`` steps with a mask beside it:

    * ``_pack_padded_sequence``: the sorted batch, time-major, flattened to ``T * B`` rows;
      ``batch_sizes`` is ``B`` at every step (a constant, so the RNN module's ``batch_sizes[0]``
      and its argument checks read the batch size), and the mask ``step < length`` of every
      (step, sequence) is kept beside it;
    * the packed ``lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``: the recurrence unrolled over
      the ``T`` steps, a step updating a sequence's state (and giving an output) only where it
      runs. A sequence's state stops at its last step, and the reverse direction of a
      bidirectional RNN starts there, so outputs and final states are eager's;
    * ``_pad_packed_sequence``: the steps that do not run set to ``padding_value``, up to
      ``total_length``.

    ``pad_packed_sequence`` without ``total_length`` returns ``T`` steps, the padded input's
    length, where eager torch returns the longest sequence's (the same where a batch is padded
    to its longest sequence, as ``pad_sequence`` and collate functions pad). Steps unrolled in
    the graph: long sequences make a long graph. ``proj_size`` is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import DataDependentError

__all__ = ["PackedRNN"]

_VF = torch._C._VariableFunctions
_RNNS = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}  # gates per cell


def _cell(kind: str, x, state, w_ih, w_hh, b_ih, b_hh):
    """One step of one direction: the new hidden state (and LSTM's cell state)."""
    gi = F.linear(x, w_ih, b_ih)
    h = state[0] if kind == "lstm" else state
    gh = F.linear(h, w_hh, b_hh)
    if kind == "lstm":
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if kind == "gru":
        ir, iz, in_ = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h
    pre = gi + gh
    return torch.tanh(pre) if kind == "rnn_tanh" else torch.relu(pre)


class PackedRNN(TorchFunctionMode):
    """Runs packed sequences as whole padded batches with a step mask (Note [packed
    sequences in a captured graph])."""

    def __init__(self) -> None:
        super().__init__()
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(batch_sizes) ->
        # (batch_sizes, the (T, B) mask of running steps)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is _VF._pack_padded_sequence:
            return self._pack(*args, **kwargs)
        if func is _VF._pad_packed_sequence and self._known(args[1]):
            return self._pad(*args, **kwargs)
        if name in _RNNS and getattr(_VF, name, None) is func and len(args) > 1:
            if isinstance(args[1], torch.Tensor) and self._known(args[1]):
                return self._rnn(name, *args, **kwargs)
        return func(*args, **kwargs)

    def _known(self, batch_sizes) -> bool:
        return isinstance(batch_sizes, torch.Tensor) and id(batch_sizes) in self._packed

    def _pack(self, x, lengths, batch_first):
        if batch_first:
            x = x.transpose(0, 1)
        steps, batch = x.shape[0], x.shape[1]
        running = torch.arange(steps, device=x.device).unsqueeze(1) < lengths.to(x.device)
        batch_sizes = torch.full((steps,), batch, dtype=torch.int64)
        self._packed[id(batch_sizes)] = (batch_sizes, running)
        return x.reshape(steps * batch, *x.shape[2:]), batch_sizes

    def _pad(self, data, batch_sizes, batch_first, padding_value, total_length):
        _, running = self._packed[id(batch_sizes)]
        steps, batch = running.shape
        x = data.reshape(steps, batch, *data.shape[1:])
        keep = running.reshape(steps, batch, *[1] * (x.ndim - 2))
        x = torch.where(keep, x, torch.full_like(x, padding_value))
        if total_length > steps:
            pad = x.new_full((total_length - steps, *x.shape[1:]), padding_value)
            x = torch.cat([x, pad])
        lengths = running.sum(0).to(torch.int64)
        return (x.transpose(0, 1) if batch_first else x), lengths

    def _rnn(self, kind, data, batch_sizes, hx, params, has_biases, num_layers, dropout,
             train, bidirectional):  # fmt: skip
        _, running = self._packed[id(batch_sizes)]
        steps, batch = running.shape
        dirs = 2 if bidirectional else 1
        per = 4 if has_biases else 2
        if len(params) != num_layers * dirs * per:
            raise DataDependentError(
                f"{kind} over packed sequences with {len(params)} weights per "
                f"{num_layers} layer(s) x {dirs} direction(s): LSTM's proj_size has no "
                "captured form (Note [packed sequences in a captured graph]). Run the RNN on "
                "the padded batch and gather each sequence's last step instead."
            )
        lstm = kind == "lstm"
        h0, c0 = (hx[0], hx[1]) if lstm else (hx, None)
        x = data.reshape(steps, batch, *data.shape[1:])
        finals_h, finals_c = [], []
        for layer in range(num_layers):
            outs = []
            for d in range(dirs):
                at = (layer * dirs + d) * per
                w_ih, w_hh = params[at], params[at + 1]
                b_ih, b_hh = (params[at + 2], params[at + 3]) if has_biases else (None, None)
                k = layer * dirs + d
                state = (h0[k], c0[k]) if lstm else h0[k]
                ys: list = [None] * steps
                for t in range(steps) if d == 0 else reversed(range(steps)):
                    new = _cell(kind, x[t], state, w_ih, w_hh, b_ih, b_hh)
                    run = running[t].unsqueeze(1)
                    if lstm:
                        state = (torch.where(run, new[0], state[0]),
                                 torch.where(run, new[1], state[1]))  # fmt: skip
                        y = new[0]
                    else:
                        state = torch.where(run, new, state)
                        y = new
                    ys[t] = torch.where(run, y, torch.zeros_like(y))
                outs.append(torch.stack(ys))
                finals_h.append(state[0] if lstm else state)
                if lstm:
                    finals_c.append(state[1])
            x = outs[0] if dirs == 1 else torch.cat(outs, 2)
            if dropout > 0 and train and layer < num_layers - 1:
                x = F.dropout(x, dropout, True)
        out = x.reshape(steps * batch, x.shape[2])
        if lstm:
            return out, torch.stack(finals_h), torch.stack(finals_c)
        return out, torch.stack(finals_h)
