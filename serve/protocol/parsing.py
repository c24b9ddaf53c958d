"""Errors and parsing: the OpenAI-style error body, the APIError that carries it, and a body validated into a
request model with its first problem as a 400 naming the parameter. The field types every request shares."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

M = TypeVar("M", bound=BaseModel)
TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what torch.Generator.manual_seed takes (plus n offsets)
NumLogprobs = Annotated[int, Field(ge=0, le=20)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the client gets as an OpenAI-style JSON body with this HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "internal_server_error")

    def __reduce__(self):  # picklable with all its fields: it crosses Ray (a gRPC stream's error does)
        return APIError, (self.status, self.message, self.param, self.code, self.type)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def parse(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its parameter."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param_path(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(
                f"{param}: this server does not support this field; leave it out", param, "unsupported_field"
            ) from None
        raise bad_request(f"{param or 'body'}: {err['msg']} (got {_short(err.get('input'))})", param) from None


_UNION_TAGS = {"str", "int", "float", "bool", "none"}


def _param_path(loc: tuple[int | str, ...]) -> str | None:
    """("messages", 1, "role") -> "messages[1].role", leaving out the union-member tags pydantic puts in
    locations ("str", "list[constrained-int]"), which are no parameter names."""
    parts = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if isinstance(p, int) or (p.isidentifier() and p not in _UNION_TAGS)
    ]
    return "".join(parts).lstrip(".") or None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
