"""The compression report printed after every compressed prefill."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompressionReport:
    """What one compression did, measured rather than planned.

    `slots_per_layer`: cache length per KV head after compression (physical). `entries_per_layer`: entries
    attended per layer, summed over KV heads (fewer than slots x heads when the `masked` mode hides some).
    `bytes_before` is what the uncompressed cache of the prompt holds, `bytes_after` the storage the cache's tensors
    hold after compression, `peak_bytes` the largest cache held during the prefill (measured after every attention
    layer: the full cache when the cut waits for the end of the prefill). `cut` says where the cache was cut.
    On a model with sliding-window layers only the full-attention ones are cut: `layers` are the model's indices of
    the layers the per-layer lists describe (the ratio is of their entries), `bounded_layers` the sliding ones, left
    to the model's window, holding `bounded_bytes` (counted in `bytes_before` and `bytes_after` alike).
    """

    method: str
    memory: str
    requested: str
    context_length: int
    num_kv_heads: int
    slots_per_layer: list[int]
    entries_per_layer: list[int]
    bytes_before: int
    bytes_after: int
    peak_bytes: int
    prefill_seconds: float
    compress_seconds: float
    cut: str
    notes: list[str] = dataclasses.field(default_factory=list)
    layers: list[int] = dataclasses.field(default_factory=list)
    bounded_layers: list[int] = dataclasses.field(default_factory=list)
    bounded_bytes: int = 0

    @property
    def bytes_freed(self) -> int:
        return self.bytes_before - self.bytes_after

    @property
    def entries_removed_fraction(self) -> float:
        total = self.context_length * self.num_kv_heads * len(self.entries_per_layer)
        return 1.0 - sum(self.entries_per_layer) / total

    @property
    def bytes_freed_fraction(self) -> float:
        return self.bytes_freed / self.bytes_before if self.bytes_before else 0.0

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(
            bytes_freed=self.bytes_freed,
            entries_removed_fraction=self.entries_removed_fraction,
            bytes_freed_fraction=self.bytes_freed_fraction,
        )
        return data

    def __str__(self) -> str:
        mib = 1 << 20
        lines = [
            f"compression report: {self.method}, {self.requested}, memory mode {self.memory}",
            f"  context tokens      {self.context_length}",
            f"  entries removed     {self.entries_removed_fraction:.1%} of {len(self.slots_per_layer)} layers x "
            f"{self.num_kv_heads} KV heads x {self.context_length} tokens",
            f"  KV cache bytes      {self.bytes_before / mib:.2f} MiB -> {self.bytes_after / mib:.2f} MiB "
            f"({self.bytes_freed / mib:.2f} MiB freed, {self.bytes_freed_fraction:.1%})",
            f"  KV cache peak       {self.peak_bytes / mib:.2f} MiB during the prefill; cut {self.cut}",
            f"  time                prefill {self.prefill_seconds * 1e3:.0f} ms, compression "
            f"{self.compress_seconds * 1e3:.0f} ms ({self._overhead():.1%} of prefill)",
        ]
        if self.bounded_layers:
            lines.append(
                f"  sliding layers      {len(self.bounded_layers)} ({_ranges(self.bounded_layers)}) bounded by their "
                f"window, left to it: {self.bounded_bytes / mib:.2f} MiB; the ratio is of the {len(self.layers)} "
                f"full-attention layers ({_ranges(self.layers)}), {(self.bytes_before - self.bounded_bytes) / mib:.2f} "
                f"MiB -> {(self.bytes_after - self.bounded_bytes) / mib:.2f} MiB"
            )
        # Two counts, not a fraction: a full cache of 3 KV heads reads "1948 s  5844 e", not 1948 of 5844 kept.
        lines.append("  kept per layer      layer: s = slots per KV head, e = entries attended over all its KV heads")
        indices = self.layers or list(range(len(self.slots_per_layer)))
        cells = [f"{i:>2}: {s:>5} s {e:>6} e" for i, s, e in zip(indices, self.slots_per_layer, self.entries_per_layer)]
        lines += ["    " + "  ".join(cells[i : i + 5]) for i in range(0, len(cells), 5)]
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)

    def _overhead(self) -> float:
        return self.compress_seconds / self.prefill_seconds if self.prefill_seconds else 0.0


def _ranges(indices: list[int]) -> str:
    """'0-4, 6-10, 12' for [0, 1, 2, 3, 4, 6, ...]: layer indices as runs."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


@dataclasses.dataclass
class BatchReport:
    """What one compressed batch holds: each row's own report (its prompt without padding), the bytes the batch's
    rectangular cache holds (every layer as long as its longest row), and what that padding costs.

    `bytes_before` is what the uncompressed padded batch holds (every row as long as the longest prompt)."""

    rows: list[CompressionReport]
    bytes_before: int
    bytes_held: int

    @property
    def bytes_of_rows(self) -> int:
        """What the rows' own compressed caches hold, without the batch's padding."""
        return sum(row.bytes_after for row in self.rows)

    @property
    def padding_bytes(self) -> int:
        return self.bytes_held - self.bytes_of_rows

    def __str__(self) -> str:
        mib = 1 << 20
        first = self.rows[0]
        lines = [
            f"batch compression report: {first.method}, {first.requested}, memory mode {first.memory}, "
            f"{len(self.rows)} prompts",
            "  row  tokens  entries removed  KV bytes held (MiB)  prefill + compression (ms)",
        ]
        lines += [
            f"  {index:>3}  {row.context_length:>6}  {row.entries_removed_fraction:>15.1%}  "
            f"{row.bytes_after / mib:>19.2f}  {(row.prefill_seconds + row.compress_seconds) * 1e3:>10.0f}"
            for index, row in enumerate(self.rows)
        ]
        lines.append(
            f"  batch KV cache      {self.bytes_before / mib:.2f} MiB uncompressed (padded) -> {self.bytes_held / mib:.2f} "
            f"MiB held, of which {self.padding_bytes / mib:.2f} MiB padding (rows padded to each layer's longest)"
        )
        return "\n".join(lines)
