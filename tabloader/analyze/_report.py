"""An analysis: the profile of a job, its rates, the model's predictions, and how to show them.

``analyze`` runs the differential runs and predicts the configurations asked for (the analyzed
one first); :meth:`Analysis.to_json` is what ``tabloader analyze --json`` prints
(``{"measured": {...}, "predictions": [...]}``) and :meth:`Analysis.format` the plain text.
Every figure's meaning is in ``docs/analyze.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tabloader._format import format_table
from tabloader.analyze._defaults import DEFAULT_BATCHES, DEFAULT_SECONDS
from tabloader.analyze._model import Prediction, Rates, WhatIf, predict
from tabloader.analyze._profile import Profile, profile_job, rates_of


@dataclass(frozen=True)
class Analysis:
    """A job's profile, the model's rates from it, and the predictions made."""

    profile: Profile
    rates: Rates
    epochs: int
    predictions: tuple[Prediction, ...]

    def measured(self) -> dict[str, Any]:
        """The figures the runs measured (G, P, C, S and the sharing), and the runs."""
        p, r = self.profile, self.rates
        b = r.batch_size
        loop = r.step_s + r.late_s + r.step_wait_s if r.step_s > 0 else r.batch_s
        storage = p.runs["cold_storage"]
        cold = p.runs["cold"]
        return {
            "job": p.job,
            "dataset": p.dataset,
            "rows": p.rows,
            "batch_size": b,
            "options": dict(p.options),
            "step_s": r.step_s,
            "workers": p.workers,
            "cache_bytes": p.cache_bytes,
            "cores": p.cores,
            "cores_got": round(r.got_cores, 3),
            "cores_got_one_worker": round(r.got_one, 3),
            "ingestion_rows_per_s": _rate(b, loop),
            "prep": {
                "rows_per_s_per_process": _rate(1, r.decode_cpu_s),
                "read_s_per_row": r.decode_cpu_s * r.read_share,
                "decode_s_per_row": r.decode_cpu_s * (1 - r.read_share),
                "service_cpu_s_per_decode": r.service_decode_cpu_s,
                "augment_s_per_row": r.augment_s,
                "augment_rows_per_s": _rate(1, r.augment_s),
                "rows_per_s": _rate(cold.rows, cold.first_s + cold.wall_s),
            },
            "cache_fetch": {
                "rows_per_s": _rate(b, r.batch_s),
                "service_cpu_s_per_row": r.service_cpu_s,
                "client_cpu_s_per_row": r.client_cpu_s,
            },
            "storage": {
                "page_cache": p.page_cache,
                "cold_bytes_per_s": _rate(storage.bytes_read, storage.read_s / p.workers),
                "cold_latency_ms": 1e3 * storage.read_s / max(1, storage.reads),
                "warm_latency_ms": 1e3 * cold.read_s / max(1, cold.reads),
                "bytes_per_row": r.stored_bytes,
                "added_s_per_row": r.storage_s,
            },
            "sharing": [asdict(o) for o in p.overlaps],
            "decoded_bytes_per_row": r.value_bytes * r.values_per_row,
            "runs": {name: asdict(run) for name, run in p.runs.items()},
        }

    def to_json(self) -> dict[str, Any]:
        """``{"measured": {...}, "predictions": [...]}``."""
        return {
            "measured": self.measured(),
            "epochs": self.epochs,
            "predictions": [p.to_json() for p in self.predictions],
        }

    def format(self) -> str:
        """The plain-text report: the rates, the sharing, then a table of predictions."""
        m = self.measured()
        prep, fetch, storage = m["prep"], m["cache_fetch"], m["storage"]
        lines = [
            f"job {m['job']} on {m['dataset']}: {m['rows']:,} rows, batches of "
            f"{m['batch_size']}, step {m['step_s']:g} s; analysed with {m['workers']} decode "
            f"processes, a {m['cache_bytes']:,}-byte cache, {m['cores']} cores (the loader got "
            f"{m['cores_got']:.2f}, with one decode process {m['cores_got_one_worker']:.2f})",
            f"ingestion G: {_show(m['ingestion_rows_per_s'])} rows/s (the loop, all cached)",
            f"prep P: {_show(prep['rows_per_s_per_process'])} rows/s a decode process (read "
            f"{1e3 * prep['read_s_per_row']:.3f} ms + decode {1e3 * prep['decode_s_per_row']:.3f}"
            f" ms a row), {_show(prep['rows_per_s'])} rows/s measured cold"
            + (
                f"; augment {_show(prep['augment_rows_per_s'])} rows/s"
                if prep["augment_s_per_row"] > 0
                else ""
            ),
            f"cache fetch C: {_show(fetch['rows_per_s'])} rows/s (service "
            f"{1e6 * fetch['service_cpu_s_per_row']:.0f} us + client "
            f"{1e6 * fetch['client_cpu_s_per_row']:.0f} us of CPU a row)",
            f"storage fetch S: {_show(storage['cold_bytes_per_s'])} bytes/s cold, "
            f"{storage['cold_latency_ms']:.3f} ms a read cold, "
            f"{storage['warm_latency_ms']:.3f} ms from the page cache "
            f"({storage['bytes_per_row']:,.0f} bytes a row; page cache {storage['page_cache']})",
        ]
        if m["sharing"]:
            lines.append(
                "sharing: "
                + "; ".join(
                    f"{o['job']} shares {o['shared']:,} rows ({o['fraction']:.0%})"
                    + ("" if o["same_decode"] else ", another decode size")
                    for o in m["sharing"]
                )
            )
        else:
            lines.append("sharing: no other registered job reads this dataset")
        rows = [
            {
                "what-if": p.what_if.label() or "(as analysed)",
                "s/epoch": f"{p.epoch_s:.2f}",
                "stall": f"{p.stall_fraction:.0%}",
                "bound": "/".join(dict.fromkeys(p.bound)),
                "decodes/row": f"{p.decodes_per_row:.2f}",
            }
            for p in self.predictions
        ]
        lines += ["", f"predictions over {self.epochs} epoch(s) of a fresh process:"]
        lines.append(format_table(rows, list(rows[0])))
        return "\n".join(lines)


def _rate(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def _show(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:,.0f}"


def analyze(
    root: str | os.PathLike[str],
    job: str,
    *,
    what_ifs: Sequence[WhatIf] = (),
    epochs: int = 1,
    step: float = 0.0,
    batches: int = DEFAULT_BATCHES,
    seconds: float = DEFAULT_SECONDS,
    workers: int | None = None,
    cache_bytes: int | None = None,
) -> Analysis:
    """Profile ``job`` (:func:`profile_job`) and predict the configuration it ran in, then
    each of ``what_ifs``, over ``epochs`` epochs of a fresh process."""
    if epochs < 1:
        from tabloader.catalog._errors import LoaderError

        raise LoaderError(f"epochs={epochs}: predict at least 1 epoch.")
    profile = profile_job(
        root,
        job,
        batches=batches,
        seconds=seconds,
        step=step,
        workers=workers,
        cache_bytes=cache_bytes,
    )
    rates = rates_of(profile)
    predictions = tuple(predict(rates, w, epochs=epochs) for w in (WhatIf(), *what_ifs))
    return Analysis(profile, rates, epochs, predictions)
