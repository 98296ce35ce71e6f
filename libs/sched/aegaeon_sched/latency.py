"""Latency estimators of the paper's Appendix A.2 (Eq. 4-6).

- Switch (Eq. 4): ``weight_bytes / pcie_bytes_per_s * beta``.
- Prefill (Eq. 5): ``C1 (4 t h^2 + 2 t h m) + C2 (3 h t2 / b) + C3`` with
  ``t`` the tokens in the batch, ``t2`` the sum of squared prompt lengths,
  ``b`` the attention kernel's block size.
- Decode step (Eq. 6): ``C4 (4 h^2 + 2 h m) + C5 (3 h t)`` with ``t`` the
  tokens in the batch (the sum of the sequences' context lengths).

Eq. 5-6 come from DistServe, where they are per transformer layer; we
multiply the ``h``/``m`` terms by ``num_layers`` so that one coefficient set
can be shared by models of different depth (the ``"*"`` entry, used for any
model without its own fit). Per-model coefficients absorb any constant factor
anyway. Eq. 6 as printed has no batch-size term although every sequence adds
sampling and kernel work; ``decode_per_seq_term=True`` appends
``C6 * B * (4 h^2 + 2 h m)`` (B = batch size), as the paper's artifact does in
its decode estimator. The default is the paper's form.

Coefficients come from a start-up profile (:meth:`LatencyModel.fit_prefill`,
:meth:`fit_decode`: least squares per model plus a shared fit) and are refined
online from measured steps (:meth:`observe_prefill`, :meth:`observe_decode`).
Both minimise *relative* squared error, since latencies span three orders of
magnitude; online, a sliding window of recent measurements fitted by least squares, shrunk
toward the start-up coefficients (:class:`~aegaeon_sched.lsq.WindowedFit`).
The model serialises to a plain dict (JSON) so the services and the simulator
share profiles.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from aegaeon_sched import lsq
from aegaeon_sched.modelspec import DecodeSample, ModelSpec, PrefillSample

__all__ = ["SHARED", "DecodeSample", "LatencyModel", "ModelSpec", "PrefillSample"]

SHARED = "*"  # coefficient key used for models without their own fit


class LatencyModel:
    """Switch, prefill and decode-step time estimates for a set of models."""

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        *,
        pcie_bytes_per_s: float,
        switch_beta: float = 0.625,
        attn_block: int = 128,
        decode_per_seq_term: bool = False,
        window: int = 256,
        refit_every: int = 16,
    ) -> None:
        self.specs: dict[str, ModelSpec] = {s.name: s for s in specs}
        self.pcie_bytes_per_s = pcie_bytes_per_s
        self.switch_beta = switch_beta
        self.attn_block = attn_block
        self.decode_per_seq_term = decode_per_seq_term
        self._window = window
        self._refit_every = refit_every
        self._prefill_coef: dict[str, tuple[float, ...]] = {}
        self._decode_coef: dict[str, tuple[float, ...]] = {}
        # Per model, the coefficients folded into the raw inputs: prefill
        # (per token, per squared token, constant); decode (constant, per
        # context token, per sequence). Rebuilt whenever coefficients change.
        self._prefill_lin: dict[str, tuple[float, float, float]] = {}
        self._decode_lin: dict[str, tuple[float, float, float]] = {}
        self._online: dict[tuple[str, str], lsq.WindowedFit] = {}
        self._pending: dict[tuple[str, str], int] = {}

    # ---- features ------------------------------------------------------
    def spec(self, model: str) -> ModelSpec:
        try:
            return self.specs[model]
        except KeyError:
            raise KeyError(f"no ModelSpec for model {model!r}") from None

    def prefill_features(self, model: str, prompt_lens: Sequence[int]) -> list[float]:
        s = self.spec(model)
        t = float(sum(prompt_lens))
        t2 = float(sum(n * n for n in prompt_lens))
        return [
            s.num_layers * t * s.layer_width,
            s.num_layers * 3.0 * s.hidden_size * t2 / self.attn_block,
            1.0,
        ]

    def decode_features(self, model: str, batch_size: int, context_tokens: int) -> list[float]:
        s = self.spec(model)
        x = [s.num_layers * s.layer_width, s.num_layers * 3.0 * s.hidden_size * context_tokens]
        if self.decode_per_seq_term:
            x.append(s.num_layers * batch_size * s.layer_width)
        return x

    def _prefill_scales(self, model: str) -> list[float]:
        # Reference batch: one 1024-token prompt.
        return self.prefill_features(model, [1024])

    def _decode_scales(self, model: str) -> list[float]:
        # Reference batch: 16 sequences holding 16k tokens.
        return self.decode_features(model, 16, 16384)

    # ---- coefficients --------------------------------------------------
    def set_prefill_coefficients(self, model: str, coef: Sequence[float]) -> None:
        if len(coef) != 3:
            raise ValueError(f"prefill needs 3 coefficients (C1..C3), got {len(coef)}")
        self._prefill_coef[model] = tuple(float(c) for c in coef)
        self._prefill_lin.clear()

    def set_decode_coefficients(self, model: str, coef: Sequence[float]) -> None:
        want = 3 if self.decode_per_seq_term else 2
        if len(coef) != want:
            raise ValueError(f"decode needs {want} coefficients, got {len(coef)}")
        self._decode_coef[model] = tuple(float(c) for c in coef)
        self._decode_lin.clear()

    def scale_coefficients(self, phase: str, factor: Mapping[str, float], default: float) -> None:
        """Multiply Eq. 5 (``phase="prefill"``) or Eq. 6 (``"decode"``) by ``factor[model]``
        (``default`` for models not in it, and for the shared fit), every model once.

        A model without its own fit reads the shared coefficients, so all of them
        are read before any is written (scaling in place in some order would scale
        such a model twice whenever the shared key came first); afterwards every
        model has its own."""
        table = self._prefill_coef if phase == "prefill" else self._decode_coef
        models = [m for m in sorted({*self.specs, SHARED}) if m in table or SHARED in table]
        base = {m: self._get(phase, m) for m in models}
        for model, coef in base.items():
            f = factor.get(model, default)
            self._set(phase, model, [c * f for c in coef])

    def prefill_coefficients(self, model: str) -> tuple[float, ...]:
        coef = self._prefill_coef.get(model) or self._prefill_coef.get(SHARED)
        if coef is None:
            raise KeyError(f"no prefill coefficients for {model!r} and no shared fit")
        return coef

    def decode_coefficients(self, model: str) -> tuple[float, ...]:
        coef = self._decode_coef.get(model) or self._decode_coef.get(SHARED)
        if coef is None:
            raise KeyError(f"no decode coefficients for {model!r} and no shared fit")
        return coef

    def fit_prefill(self, samples: Iterable[PrefillSample]) -> None:
        """Least squares per model (when determined) and a shared fit over all."""
        self._fit(
            "prefill",
            [(s.model, self.prefill_features(s.model, s.prompt_lens), s.seconds) for s in samples],
        )

    def fit_decode(self, samples: Iterable[DecodeSample]) -> None:
        self._fit(
            "decode",
            [
                (s.model, self.decode_features(s.model, s.batch_size, s.context_tokens), s.seconds)
                for s in samples
            ],
        )

    def _phase_scales(self, phase: str, model: str) -> list[float]:
        return self._prefill_scales(model) if phase == "prefill" else self._decode_scales(model)

    def _set(self, phase: str, model: str, coef: Sequence[float]) -> None:
        if phase == "prefill":
            self.set_prefill_coefficients(model, coef)
        else:
            self.set_decode_coefficients(model, coef)

    def _get(self, phase: str, model: str) -> tuple[float, ...]:
        if phase == "prefill":
            return self.prefill_coefficients(model)
        return self.decode_coefficients(model)

    def _fit(self, phase: str, rows: Sequence[tuple[str, list[float], float]]) -> None:
        by_model: dict[str, tuple[list[list[float]], list[float]]] = {}
        for model, x, y in rows:
            xs, ys = by_model.setdefault(model, ([], []))
            xs.append(x)
            ys.append(y)
        if not by_model:
            return
        shared = lsq.fit(
            [x for _, x, _ in rows],
            [y for _, _, y in rows],
            self._phase_scales(phase, next(iter(by_model))),
            [lsq.relative_weight(y) for _, _, y in rows],
        )
        if shared is not None:
            self._set(phase, SHARED, shared)
        for model, (xs, ys) in by_model.items():
            coef = lsq.fit(
                xs, ys, self._phase_scales(phase, model), [lsq.relative_weight(y) for y in ys]
            )
            if coef is not None:
                self._set(phase, model, coef)
            self._online.pop((phase, model), None)

    # ---- online refinement ---------------------------------------------
    def observe_prefill(self, model: str, prompt_lens: Sequence[int], seconds: float) -> None:
        """Record a measured prefill; coefficients refit every ``refit_every`` samples."""
        self._observe("prefill", model, self.prefill_features(model, prompt_lens), seconds)

    def observe_decode(
        self, model: str, batch_size: int, context_tokens: int, seconds: float
    ) -> None:
        x = self.decode_features(model, batch_size, context_tokens)
        self._observe("decode", model, x, seconds)

    def _observe(self, phase: str, model: str, x: list[float], seconds: float) -> None:
        key = (phase, model)
        online = self._online.get(key)
        if online is None:
            online = lsq.WindowedFit(
                self._get(phase, model), self._phase_scales(phase, model), window=self._window
            )
            self._online[key] = online
        online.add(x, seconds, lsq.relative_weight(seconds))
        self._pending[key] = self._pending.get(key, 0) + 1
        if self._pending[key] >= self._refit_every:
            self._pending[key] = 0
            self._set(phase, model, online.coefficients())

    # ---- estimates -----------------------------------------------------
    def switch_s(self, model: str) -> float:
        """Eq. 4: time to load the model's weights over PCIe."""
        return self.spec(model).weight_bytes / self.pcie_bytes_per_s * self.switch_beta

    def prefill_s(self, model: str, prompt_lens: Sequence[int]) -> float:
        """Eq. 5 for a batch of prompts (never below zero)."""
        lin = self._prefill_lin.get(model) or self._build_prefill_lin(model)
        t = sum(prompt_lens)
        t2 = sum(n * n for n in prompt_lens)
        return max(0.0, lin[0] * t + lin[1] * t2 + lin[2])

    def prefill_one_s(self, model: str, prompt_len: int) -> float:
        lin = self._prefill_lin.get(model) or self._build_prefill_lin(model)
        return max(0.0, lin[0] * prompt_len + lin[1] * prompt_len * prompt_len + lin[2])

    def decode_step_s(self, model: str, batch_size: float, context_tokens: float) -> float:
        """Eq. 6 for one step of a batch holding ``context_tokens`` tokens (linear in
        both, so a mean batch over many steps gives their mean step)."""
        lin = self._decode_lin.get(model) or self._build_decode_lin(model)
        return max(0.0, lin[0] + lin[1] * context_tokens + lin[2] * batch_size)

    def _build_prefill_lin(self, model: str) -> tuple[float, float, float]:
        s = self.spec(model)
        c1, c2, c3 = self.prefill_coefficients(model)
        lin = (
            c1 * s.num_layers * s.layer_width,
            c2 * s.num_layers * 3.0 * s.hidden_size / self.attn_block,
            c3,
        )
        self._prefill_lin[model] = lin
        return lin

    def _build_decode_lin(self, model: str) -> tuple[float, float, float]:
        s = self.spec(model)
        coef = self.decode_coefficients(model)
        per_seq = coef[2] * s.num_layers * s.layer_width if len(coef) > 2 else 0.0
        # A context term fitted below zero (a profile on a busy machine) counts as zero:
        # a step never gets faster as its context grows.
        per_token = max(0.0, coef[1]) * s.num_layers * 3.0 * s.hidden_size
        lin = (coef[0] * s.num_layers * s.layer_width, per_token, per_seq)
        self._decode_lin[model] = lin
        return lin

    # ---- serialisation -------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "pcie_bytes_per_s": self.pcie_bytes_per_s,
            "switch_beta": self.switch_beta,
            "attn_block": self.attn_block,
            "decode_per_seq_term": self.decode_per_seq_term,
            "models": {name: asdict(spec) for name, spec in self.specs.items()},
            "prefill_coef": {k: list(v) for k, v in self._prefill_coef.items()},
            "decode_coef": {k: list(v) for k, v in self._decode_coef.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyModel:
        if data.get("version") != 1:
            raise ValueError(f"unsupported latency profile version {data.get('version')!r}")
        model = cls(
            (ModelSpec(**spec) for spec in data["models"].values()),
            pcie_bytes_per_s=float(data["pcie_bytes_per_s"]),
            switch_beta=float(data["switch_beta"]),
            attn_block=int(data["attn_block"]),
            decode_per_seq_term=bool(data["decode_per_seq_term"]),
        )
        for name, coef in data.get("prefill_coef", {}).items():
            model.set_prefill_coefficients(name, coef)
        for name, coef in data.get("decode_coef", {}).items():
            model.set_decode_coefficients(name, coef)
        return model
