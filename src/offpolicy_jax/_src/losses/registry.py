"""The registry of policy-loss surrogates: one function and its hyperparameters, by name.

A surrogate is the per-token loss ``ℓ`` of :func:`~offpolicy_jax.policy_loss` (PPO's
clipped objective, GSPO, CISPO, ...). It is registered with
:func:`register_surrogate` under the name ``LossConfig.policy_loss`` selects it by,
together with its hyperparameters: a small frozen dataclass whose field defaults are
the surrogate's defaults and whose ``__post_init__`` validates them. The built-in
surrogates (:mod:`offpolicy_jax._src.losses.builtins`) are registered exactly like a user's::

    @dataclasses.dataclass(frozen=True)
    class ScaledParams:
        scale: float = 1.0

    @opj.register_surrogate("scaled_pg", params=ScaledParams)
    def scaled_pg(x: opj.SurrogateInput, p: ScaledParams) -> opj.SurrogateTerms:
        return opj.SurrogateTerms(-p.scale * x.advantages * jnp.where(x.valid, x.logp, 0.0))

    cfg = opj.LossConfig(policy_loss="scaled_pg", scale=0.5)

``LossConfig`` takes the hyperparameters as flat keywords (``scale=0.5``) and holds
them as ``cfg.params`` (an instance of the registered class); ``cfg.scale`` reads one
(the built-ins' are typed attributes of ``LossConfig``; a type checker sees a user
surrogate's as ``cfg.params.scale``).
The pipeline around a surrogate (the correction's IS weights and mask, the algorithm's
ratio denominator, aggregation, metrics, packing, sharding) is the same for all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar, overload

import jax

from offpolicy_jax._src.correction.topk_divergence import TopKTerms
from offpolicy_jax._src.messages import close_match, shown
from offpolicy_jax._src.reduction import Column, Rows

__all__ = [
    "NoParams",
    "Surrogate",
    "SurrogateInput",
    "SurrogateTerms",
    "build_params",
    "lookup",
    "names",
    "register_surrogate",
]


class SurrogateTerms(NamedTuple):
    """Per-token outputs of a surrogate, all ``[..., T]``.

    ``loss`` is ``ℓ`` (differentiable w.r.t. ``logp``); ``clipped`` feeds
    ``pg_clipfrac`` and ``clipped_lower`` ``pg_clipfrac_lower`` (bool; None where the
    surrogate has no such notion). ``metrics`` names the surrogate's own metrics: each
    a :class:`~offpolicy_jax._src.reduction.Column` over ``x.mask`` (e.g.
    ``reduction.count_where(masked, x.mask)``), reduced like ``pg_clipfrac``
    (``LossConfig.metric_reduction``) and pooled exactly over micro-batches and devices.
    """

    loss: jax.Array
    clipped: jax.Array | None = None
    clipped_lower: jax.Array | None = None
    metrics: Mapping[str, Column] | None = None


class SurrogateInput(NamedTuple):
    """What a surrogate sees of the batch; token arrays are ``[..., T]``.

    Attributes:
      logp: log π_θ, the differentiated input. Garbage (NaN, inf) may sit where
        ``valid`` is False: read it through ``jnp.where(valid, logp, 0.0)`` or
        ``log_ratio``.
      log_ratio: ``x = log π_θ − log π_d`` where valid and finite, else exactly 0
        (differentiable w.r.t. ``logp``).
      denominator: log π_d, the ratio's denominator the algorithm chose (π_old, or
        π_rollout in bypass mode); stop-gradient.
      advantages: ``A``, 0 where not valid; stop-gradient.
      valid: bool, the tokens of the original mask.
      mask: float ``m'``, the mask after the correction's rejection.
      weights: stop-gradient IS weights (meaningful where ``mask > 0``), or None.
        The pipeline multiplies ``ℓ`` by them, unless the surrogate was registered
        with ``applies_weights=True`` (then it folds them in itself, as GMPO does).
      layout: the per-sequence seam: ``layout.reduce({name: Column})`` gives
        per-sequence sums (rows, or packed segments), ``layout.broadcast`` maps them
        back to tokens; see :mod:`offpolicy_jax._src.reduction`.
      rollout: log π_rollout (stop-gradient; garbage where not ``valid``), or None
        when the call passed no ``rollout_logp``: for surrogates that compare the
        trainer with the inference engine themselves.
      key: the ``key=`` PRNG key of the call (None if not passed): for surrogates
        that choose tokens at random; the library draws no randomness of its own.
      topk: the call's ``topk=`` (None if not passed), checked: a
        :class:`~offpolicy_jax._src.correction.topk_divergence.TopKTerms` with both policies'
        log-probs on the engine's top-k ids (``[..., T, K]``, stop-gradient) and their
        per-token ``tv`` / ``kl`` (DPPO's top-k divergences), for surrogates whose trust
        region is taken over that support.
    """

    logp: jax.Array
    log_ratio: jax.Array
    denominator: jax.Array
    advantages: jax.Array
    valid: jax.Array
    mask: jax.Array
    weights: jax.Array | None
    layout: Rows
    rollout: jax.Array | None = None
    key: jax.Array | None = None
    topk: TopKTerms | None = None


@dataclasses.dataclass(frozen=True)
class NoParams:
    """The hyperparameters of a surrogate that has none."""


class _Dataclass(Protocol):
    """Any dataclass (as typeshed's ``DataclassInstance``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


Params = TypeVar("Params", bound=_Dataclass)
"""A surrogate's hyperparameters: its registered frozen dataclass."""

SurrogateFn = Callable[[SurrogateInput, Params], SurrogateTerms]
"""``fn(x, params) -> SurrogateTerms``, generic in the params class it is registered with."""


@dataclasses.dataclass(frozen=True)
class Surrogate(Generic[Params]):
    """A registered surrogate.

    Attributes:
      name: the ``LossConfig.policy_loss`` value that selects it.
      fn: ``fn(x: SurrogateInput, params) -> SurrogateTerms``: per-token ``ℓ`` and
        the clipped indicators behind ``pg_clipfrac`` / ``pg_clipfrac_lower``.
      params: the frozen dataclass of its hyperparameters (defaults, validation).
      applies_weights: ``fn`` applies the IS weights itself.
    """

    name: str
    fn: SurrogateFn[Params]
    params: type[Params]
    applies_weights: bool = False

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.params))


# Any: each entry has its own params class.
_REGISTRY: dict[str, Surrogate[Any]] = {}
# LossConfig's own field names: a surrogate's hyperparameters become LossConfig keywords,
# so they may not shadow them (the registry sits below the config and names them itself;
# the tests check that this list is LossConfig's fields).
_RESERVED: tuple[str, ...] = (
    "algorithm",
    "correction",
    "aggregation",
    "rejected_in_denominator",
    "get_mismatch_metrics",
    "metric_reduction",
    "policy_loss",
    "params",
    "opsm_delta",
    "loss_scale_factor",
    "kl_coef",
    "kl_estimator",
    "kl_off_policy",
    "entropy_coef",
    "prox_logp_method",
    "positive_example_nll_weight",
)


@overload
def register_surrogate(
    name: str,
    *,
    applies_weights: bool = False,
    replace: bool = False,
) -> Callable[[SurrogateFn[NoParams]], SurrogateFn[NoParams]]: ...
@overload
def register_surrogate(
    name: str,
    *,
    params: type[Params],
    applies_weights: bool = False,
    replace: bool = False,
) -> Callable[[SurrogateFn[Params]], SurrogateFn[Params]]: ...
def register_surrogate(
    name: str,
    *,
    params: type[Any] = NoParams,
    applies_weights: bool = False,
    replace: bool = False,
) -> Callable[[SurrogateFn[Any]], SurrogateFn[Any]]:
    """Registers a surrogate under ``name`` (a decorator); ``LossConfig(policy_loss=name)``.

    Args:
      name: the key, e.g. ``"my_loss"``.
      params: a frozen dataclass of the hyperparameters: every field has a default
        (the surrogate's default) and ``__post_init__`` raises ``ValueError`` naming
        ``LossConfig.<field>`` for a bad value. Its field names become
        ``LossConfig`` keywords, so they may not be ``LossConfig``'s own fields.
      applies_weights: the function applies ``x.weights`` itself; by default the
        pipeline multiplies its ``ℓ`` by them.
      replace: allow re-registering an existing name (else ``ValueError``).

    Returns:
      The decorator; it returns the function unchanged.

    Raises:
      ValueError: a taken name, or hyperparameters that are not a frozen dataclass
        with defaults, or whose names clash with ``LossConfig``'s fields.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"register_surrogate: name must be an identifier string, got {shown(name)}"
        )
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"register_surrogate: {name!r} is already registered; pass replace=True to replace it"
        )
    _check_params_type(name, params)

    def decorator(fn: SurrogateFn[Any]) -> SurrogateFn[Any]:
        if not callable(fn):
            raise TypeError(f"register_surrogate({name!r}) decorates a function, got {fn!r}")
        _REGISTRY[name] = Surrogate(name, fn, params, applies_weights)
        return fn

    return decorator


def _check_params_type(name: str, params: type) -> None:
    owner = f"register_surrogate({name!r})"
    if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
        raise ValueError(f"{owner}: params must be a dataclass type, got {params!r}")
    if not params.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise ValueError(f"{owner}: params must be frozen (LossConfig is hashable)")
    for f in dataclasses.fields(params):
        missing = dataclasses.MISSING
        if f.default is missing and f.default_factory is missing:
            raise ValueError(f"{owner}: hyperparameter {f.name!r} needs a default")
        if f.name in _RESERVED or f.name == "params":
            raise ValueError(
                f"{owner}: hyperparameter {f.name!r} clashes with the LossConfig field of "
                "that name; choose another name"
            )


def names() -> tuple[str, ...]:
    """The registered surrogate names, in registration order (built-ins first)."""
    return tuple(_REGISTRY)


def lookup(name: object, owner: str = "LossConfig.policy_loss") -> Surrogate[Any]:
    """The surrogate registered as ``name``; ``ValueError`` with a did-you-mean hint."""
    if isinstance(name, str) and name in _REGISTRY:
        return _REGISTRY[name]
    known = list(_REGISTRY)
    hint = ""
    if isinstance(name, str):
        close = [k for k in known if k.startswith(name)] if name else []
        close = close or [c for c in [close_match(name, known)] if c]
        hint = f" (did you mean {shown(close[0])}?)" if close else ""
    raise ValueError(f"{owner} must be one of {known}, got {shown(name)}{hint}")


def hyperparameter_owners() -> dict[str, tuple[str, ...]]:
    """Every registered hyperparameter name -> the surrogates that take it."""
    owners: dict[str, list[str]] = {}
    for entry in _REGISTRY.values():
        for key in entry.param_names:
            owners.setdefault(key, []).append(entry.name)
    return {key: tuple(v) for key, v in owners.items()}


# Keywords every LossConfig accepts whatever its surrogate: the spec's constructor has
# always taken clip_eps (default 0.2). A surrogate without a clip range validates it as
# PPO's and ignores it.
UNIVERSAL_KEYS: tuple[str, ...] = ("clip_eps",)


def build_params(name: str, values: Mapping[str, object], base: object = None) -> Any:
    """The hyperparameters of surrogate ``name`` from flat ``LossConfig`` keywords.

    Args:
      name: a registered surrogate.
      values: keyword -> value; ``None`` means the surrogate's default.
      base: a params instance to start from (``dataclasses.replace`` of a config):
        kept as it is if it is ``name``'s type, else its non-default values are read
        as keywords (so one another surrogate lacks raises, as if passed).

    Returns:
      An instance of the surrogate's params class (validated by it).

    Raises:
      ValueError: a hyperparameter of another surrogate, or a bad value (from the
        params class).
      TypeError: an unknown keyword (with a did-you-mean hint).
    """
    entry = lookup(name)
    values = dict(values)
    start: dict[str, object] = {}
    if base is not None and type(base) is not entry.params:
        if not dataclasses.is_dataclass(base):
            raise ValueError(f"LossConfig.params must be a surrogate's params, got {shown(base)}")
        for f in dataclasses.fields(base):
            value = getattr(base, f.name)
            if value != f.default:
                values.setdefault(f.name, value)
    elif base is not None:
        start = {f.name: getattr(base, f.name) for f in dataclasses.fields(entry.params)}
    own = entry.param_names
    owners = hyperparameter_owners()
    for key, value in values.items():
        if key in own:
            if value is not None:
                start[key] = value
        elif key in UNIVERSAL_KEYS:
            _validate_universal(key, value)
        elif key in owners:
            if value is not None:
                takers = " / ".join(repr(x) for x in owners[key])
                raise ValueError(
                    f"LossConfig.{key} is a hyperparameter of policy_loss {takers}, not of "
                    f"{name!r}; leave it None"
                )
        else:
            # As Python's own error for an unknown keyword (configs' keyword_hints).
            allowed = sorted(set(_RESERVED) - {"params"} | set(owners) | set(UNIVERSAL_KEYS))
            close = close_match(str(key), allowed)
            hint = f"; did you mean {shown(close)}?" if close else ""
            raise TypeError(
                f"LossConfig() got an unexpected keyword argument {shown(key)}{hint} "
                f"(allowed: {', '.join(allowed)})"
            )
    return entry.params(**start)


def _validate_universal(key: str, value: object) -> None:
    if value is None:
        return
    for entry in _REGISTRY.values():
        if key in entry.param_names:
            entry.params(**{key: value})  # validated as the first surrogate that takes it
            return
