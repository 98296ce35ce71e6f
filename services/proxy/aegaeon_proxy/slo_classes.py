"""A request's SLO class and targets: what it asked for, bounded by what the operator allows.

The request fields (checked in :mod:`aegaeon_proxy.params`) are ``priority``
(an SLO class of :mod:`aegaeon_sched.priority`) and explicit ``ttft_ms`` /
``tbt_ms``. :func:`resolve` turns them into the request's own targets and the
rank the scheduler orders and sheds by (:class:`RequestSLO`):

* **Which classes a caller may use**: those its API key lists
  (``proxy.api_keys[].slo_classes``) and the model allows
  (``model_settings.<model>.slo_classes``); empty lists allow every class.
  Asking for another is a **403** ``slo_class_not_allowed`` naming
  ``priority``: the request is well formed, the caller lacks the permission
  (OpenAI answers permission problems with 403, vLLM and others follow).
  Without ``priority`` a request is ``standard``, or, where ``standard`` is
  not allowed, the lowest class allowed.
* **Explicit targets** replace the class's: ``ttft_ms`` may not be below the
  floors (``min_ttft_s`` of the key and of the model) nor, when the key or
  the model limits the classes, below the tightest TTFT of the classes it
  allows (likewise ``tbt_ms``): 403 ``slo_target_not_allowed`` naming the field.
  The class (for shedding) stays the one asked for or defaulted.
* **Classes off** (``slo_classes.enabled: false``): the fields are still
  checked as above, and every request is scheduled as ``standard`` with the
  deployment's targets (the paper's one SLO).

Class targets default to multiples of the model's SLO
(:data:`aegaeon_sched.priority.DEFAULT_FACTORS`) unless ``slo_classes.<class>``
sets them.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegaeon_common.config import ApiKeyConfig, Config, ModelSettings, SLOClassConfig
from aegaeon_sched import SLOClass, SLOClasses
from aegaeon_sched.priority import CLASS_NAMES, DEFAULT_CLASS, STANDARD

from aegaeon_proxy.errors import APIError

__all__ = ["RequestSLO", "class_table", "resolve"]


@dataclass(frozen=True)
class RequestSLO:
    """What one request is scheduled with and measured against."""

    slo_class: str  # the class asked for (or defaulted)
    priority: int  # the rank the scheduler uses (standard's when classes are off)
    ttft_s: float | None  # the request's own targets for the scheduler (None: the deployment's)
    tbt_s: float | None
    targets: tuple[float, float]  # (TTFT, TBT) its tokens' deadlines are measured by


def class_table(config: Config, ttft_s: float, tbt_s: float) -> SLOClasses:
    """The deployment's classes for an SLO of (``ttft_s``, ``tbt_s``), with the
    ``slo_classes`` section's overrides."""
    defaults = SLOClasses.default(ttft_s, tbt_s)
    out: list[SLOClass] = []
    for c in defaults.classes:
        cfg: SLOClassConfig = getattr(config.slo_classes, c.name)
        out.append(SLOClass(
            c.name, c.rank,
            cfg.ttft_s if cfg.ttft_s is not None else c.ttft_s,
            cfg.tbt_s if cfg.tbt_s is not None else c.tbt_s,
            cfg.admit_fraction if cfg.admit_fraction is not None else c.admit_fraction,
            cfg.defer if cfg.defer is not None else c.defer,
        ))  # fmt: skip
    return SLOClasses(tuple(out))


def _forbidden(param: str, message: str, code: str) -> APIError:
    return APIError(403, message, param=param, code=code)


def _floor(values: list[float | None]) -> float | None:
    given = [v for v in values if v is not None]
    return max(given) if given else None


def resolve(
    config: Config,
    model: str,
    settings: ModelSettings,
    key: ApiKeyConfig | None,
    *,
    priority: str | None,
    ttft_s: float | None,
    tbt_s: float | None,
    model_slo: tuple[float, float],
) -> RequestSLO:
    """The request's class and targets; a 403 :class:`APIError` for what it may not ask."""
    classes = class_table(config, *model_slo)
    key_classes = key.slo_classes if key is not None else ()
    limited = bool(key_classes or settings.slo_classes)
    allowed = [n for n in CLASS_NAMES
               if (not key_classes or n in key_classes)
               and (not settings.slo_classes or n in settings.slo_classes)]  # fmt: skip
    # "with this API key" only where there is one (keys off: the model's settings alone)
    whom = f"model '{model}'" + (" with this API key" if key is not None else "")
    if not allowed:
        raise _forbidden("priority", f"no SLO class is allowed for {whom}",
                         "slo_class_not_allowed")  # fmt: skip
    if priority is None:
        name = DEFAULT_CLASS if DEFAULT_CLASS in allowed else allowed[-1]
    elif priority in allowed:
        name = priority
    else:
        raise _forbidden(
            "priority", f"priority '{priority}' is not allowed for {whom} "
            f"(allowed: {', '.join(allowed)})", "slo_class_not_allowed",
        )  # fmt: skip
    cls = classes.get(name)
    checks = (
        ("ttft_ms", ttft_s, [key.min_ttft_s if key is not None else None, settings.min_ttft_s,
                             min(classes.get(n).ttft_s for n in allowed) if limited else None]),
        ("tbt_ms", tbt_s, [key.min_tbt_s if key is not None else None, settings.min_tbt_s,
                           min(classes.get(n).tbt_s for n in allowed) if limited else None]),
    )  # fmt: skip
    for param, asked, floors in checks:
        floor = _floor(floors)
        if asked is not None and floor is not None and asked < floor:
            raise _forbidden(
                param, f"'{param}' may not be below {floor * 1000:g} ms for {whom}, "
                f"got {asked * 1000:g}", "slo_target_not_allowed",
            )  # fmt: skip
    ttft = ttft_s if ttft_s is not None else cls.ttft_s
    tbt = tbt_s if tbt_s is not None else cls.tbt_s
    if not config.slo_classes.enabled:  # every request as standard, the deployment's SLO
        return RequestSLO(name, STANDARD, None, None, model_slo)
    return RequestSLO(name, cls.rank, ttft, tbt, (ttft, tbt))
