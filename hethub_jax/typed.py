"""Strict, frozen pydantic v2 models for configs and plans, and readable errors from them (pure Python).

Every configuration object of the package (plan, model config, training config sections) is a
:class:`StrictModel`: frozen (hashable, usable as static data of jitted functions), strict (no silent
coercion: ``"2"`` is not an integer, ``True`` is not a number; an integer is accepted where a float is
expected) and closed (an unknown key is an error). pydantic checks keys and types; cross-field rules
stay in each model's validators and ``validate`` methods.

pydantic's :class:`~pydantic.ValidationError` is turned into a plain ``ValueError`` whose message names
the key and where it is (``replicas[0].stages[1].tp must be an integer, got '2'``) by
:func:`error_message`; a wrong type raises :class:`FieldTypeError`, which is both a ``ValueError`` and a
``TypeError`` (as Python raises ``TypeError`` for a bad argument).
"""
from __future__ import annotations

import typing
from typing import Annotated, Any, Mapping, Optional, TypeVar, Union

import annotated_types
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo

__all__ = ["StrictModel", "TupleOf", "Float", "FieldTypeError", "error_message", "to_value_error",
           "validate_model", "unknown_keys"]

T = TypeVar("T")


class FieldTypeError(ValueError, TypeError):
    """A value of the wrong type (an integer field given ``"2"``, a flag given ``"yes"``)."""


def _list_to_tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _yaml11_float(v: Any, info: ValidationInfo) -> Any:
    """YAML 1.1 (PyYAML) reads ``3e-3`` (no dot) as a string: accept it as the number it means, only
    where a float is expected and only when validating YAML (context ``{"yaml": True}``)."""
    if isinstance(v, str) and info.context and info.context.get("yaml"):
        try:
            return float(v)
        except ValueError:
            return v
    return v


# A JSON array (a list) read into a tuple: the models stay hashable. Items are validated strictly.
TupleOf = Annotated[tuple[T, ...], BeforeValidator(_list_to_tuple)]
# A finite float; an int is accepted (JSON ``1`` for ``1.0``); in YAML, ``3e-3`` too.
Float = Annotated[float, BeforeValidator(_yaml11_float), Field(allow_inf_nan=False)]


class StrictModel(BaseModel):
    """Base of the package's frozen, strict, closed models. Constructing one with bad fields raises
    ``ValueError`` (:class:`FieldTypeError` for a wrong type) naming the field, not pydantic's
    ``ValidationError``.

    Adapter note: pydantic has no public switch for "wrap the constructor's errors but not
    ``model_validate``'s"; this ``__init__`` carries pydantic's own marker ``__pydantic_base_init__``
    so that validation of nested models bypasses it and keeps their locations. If a pydantic release
    drops the marker, ``tests/test_typed.py`` and ``tests/test_plan.py`` (nested error paths) fail.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise to_value_error(e, type(self), root=type(self).__name__) from None

    # Validation (``model_validate``, nested models) must not go through this ``__init__``, or nested
    # errors would lose their location: pydantic skips an ``__init__`` marked as its own.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------
# errors

_TYPE_ERRORS = {"int_type", "int_from_float", "int_parsing", "float_type", "float_parsing", "bool_type",
                "bool_parsing", "string_type", "tuple_type", "list_type", "dict_type", "model_type",
                "model_attributes_type", "dataclass_type", "none_required", "is_instance_of"}


def _where(root: str, loc: tuple) -> str:
    out = root
    for key in loc:
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            out += f".{key}" if out else str(key)
    return out


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


def _field_at(model: type[BaseModel], loc: tuple) -> tuple[Optional[type[BaseModel]], Any]:
    """The model holding the last key of ``loc`` and that key's ``FieldInfo`` (``None`` if unknown)."""
    holder, field = model, None
    for key in loc:
        if isinstance(key, int):
            continue
        if holder is None or key not in holder.model_fields:
            return None, None
        field = holder.model_fields[key]
        found = _models_in(field.annotation)
        holder, last = (found[0] if found else None), holder
    return (last if field is not None else model), field


def _unwrap(annotation: Any) -> tuple[Any, list, bool]:
    """``(base type, constraint metadata, nullable)`` of ``Optional[Annotated[T, ...]]`` and the like."""
    metadata, nullable = [], False
    while True:
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is Annotated:
            annotation, metadata = args[0], metadata + list(annotation.__metadata__)
        elif origin is Union and type(None) in args and len(args) == 2:
            annotation, nullable = next(a for a in args if a is not type(None)), True
        else:
            return annotation, metadata, nullable


def _type_words(annotation: Any) -> str:
    base = _unwrap(annotation)[0]
    if typing.get_origin(base) in (tuple, list):
        return "a list"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(
        base, "a JSON object")


def _expected(field: Any, item: bool) -> str:
    """``"an integer >= 1"``, ``"a non-empty string or null"``, ... for a field (or one item of it)."""
    base, metadata, nullable = _unwrap(field.annotation)
    if item:
        args = typing.get_args(base)
        return _type_words(args[0]) if args else "a valid item"
    words = _type_words(base)
    for m in list(field.metadata) + metadata:
        if isinstance(m, annotated_types.Ge):
            words += f" >= {m.ge}"
        elif isinstance(m, annotated_types.Gt):
            words += f" > {m.gt}"
        elif getattr(m, "min_length", None) == 1 and words == "a string":  # MinLen, StringConstraints
            words = "a non-empty string"
    return words + (" or null" if nullable else "")


def error_message(err: ValidationError, model: type[BaseModel], root: str = "",
                  container: Optional[str] = None) -> tuple[str, bool]:
    """``(message, is_type_error)`` for the first error of ``err`` (raised validating ``model``).

    ``root`` prefixes locations (``"train"`` -> ``train.steps``); ``container`` names the top level in
    key errors (``"plan"``, ``"section 'train'"``); it defaults to ``root``. Messages of the models'
    own validators are kept as written, prefixed by ``"root: "`` unless they already start with the
    location.
    """
    e = err.errors(include_url=False)[0]
    loc, kind, value = tuple(e["loc"]), e["type"], e.get("input")
    where = _where(root, loc)
    parent = _where(root, loc[:-1]) if loc[:-1] else (container or root or model.__name__)
    if kind == "extra_forbidden":
        holder, _ = _field_at(model, loc[:-1])
        allowed = f"; allowed keys: {list(holder.model_fields)}" if holder is not None else ""
        if holder is not None:
            import difflib
            close = difflib.get_close_matches(str(loc[-1]), list(holder.model_fields), n=1, cutoff=0.6)
            allowed += f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown key {loc[-1]!r} in {parent}{allowed}", False
    if kind == "missing":
        return f"missing key {loc[-1]!r} in {parent}", False
    if kind in ("value_error", "assertion_error"):
        msg = str(e["ctx"]["error"]) if "error" in e.get("ctx", {}) else e["msg"]
        if not root or msg.startswith(where):
            return msg, False
        return f"{root}: {msg}", False
    if kind == "literal_error":
        return f"{where} must be {e['ctx']['expected']}, got {value!r}", False
    _, field = _field_at(model, loc)
    if field is not None:
        words = _expected(field, item=isinstance(loc[-1], int))
        return f"{where} must be {words}, got {value!r}", kind in _TYPE_ERRORS
    return f"{where or container or model.__name__}: {e['msg']}, got {value!r}", kind in _TYPE_ERRORS


def to_value_error(err: ValidationError, model: type[BaseModel], root: str = "",
                   container: Optional[str] = None, cls: type[ValueError] = ValueError) -> ValueError:
    """The ``ValueError`` to raise for ``err`` (see :func:`error_message`): of class ``cls``, or
    :class:`FieldTypeError` for a wrong type when ``cls`` is ``ValueError``."""
    msg, is_type = error_message(err, model, root, container)
    return FieldTypeError(msg) if is_type and cls is ValueError else cls(msg)


M = TypeVar("M", bound=BaseModel)


def validate_model(model: type[M], data: Any, root: str = "", container: Optional[str] = None,
                   cls: type[ValueError] = ValueError, yaml: bool = False) -> M:
    """``model.model_validate(data)`` with errors as :func:`to_value_error`. ``yaml``: accept YAML 1.1
    float strings (``3e-3``) where a float is expected.

    Raises:
      ValueError: (``cls``) for a value that is not a JSON object, an unknown or missing key, a wrong
        type or a violated constraint, naming the key and where it is.
    """
    if not isinstance(data, (Mapping, BaseModel)):
        raise cls(f"{container or root or model.__name__} must be a JSON object (a mapping), got "
                  f"{type(data).__name__}: {data!r}")
    try:
        return model.model_validate(dict(data) if isinstance(data, Mapping) else data,
                                    context={"yaml": yaml})
    except ValidationError as e:
        raise to_value_error(e, model, root, container, cls) from None


def unknown_keys(model: type[BaseModel], data: Mapping[str, Any], what: str) -> None:
    """Raises ``ValueError("unknown {what} key(s) [...]; known keys: [...]")`` if ``data`` has keys
    that are not fields of ``model`` (all of them at once, sorted), followed by
    ``"; did you mean 'seq_len' for 'seqlen'?"`` where a known key is close (``difflib``)."""
    import difflib
    unknown = sorted(set(data) - set(model.model_fields))
    if unknown:
        hints = [f"{close[0]!r} for {k!r}" for k in unknown
                 for close in [difflib.get_close_matches(str(k), list(model.model_fields), n=1, cutoff=0.6)] if close]
        hint = f"; did you mean {', '.join(hints)}?" if hints else ""
        raise ValueError(f"unknown {what} key(s) {unknown}; known keys: {sorted(model.model_fields)}{hint}")
