"""What the server may ask of the store's writer process, and who answers: a registry of typed requests.

The writer process is the only one that can read or write the store while the collector runs, so
the control API's commands, the query API's SQL, the run metrics and the collector's health counters
all travel to it as requests. Each request is a dataclass (a subclass of `Request`, typed by its
reply); the module that owns an operation registers the function that answers it with `handles`.
A request crosses the process boundary pickled, which imports its class's module in the writer
process, and with it the registration: the writer needs no list of operations.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import duckdb

Reply = TypeVar("Reply")
T = TypeVar("T")


class Request(Generic[Reply]):
    """The base of every request dataclass; `Reply` is the type of its answer."""


@dataclass(frozen=True)
class Context:
    """What a handler works with: a connection to the store (the writer's own for a handler that runs
    between commits, a cursor of its own for one that runs beside them) and the tasks the writer runs."""

    con: "duckdb.DuckDBPyConnection"
    tasks: Sequence[object] = ()

    def task(self, kind: type[T]) -> T:
        """The writer's task of type `kind`; LookupError when it runs none."""
        for task in self.tasks:
            if isinstance(task, kind):
                return task
        raise LookupError(f"the store's writer runs no {kind.__name__}")


@dataclass(frozen=True)
class Handler:
    """How a request type is answered.

    `function`: (context, request) -> reply. `beside`: runs on a query thread with a cursor of its own,
    beside the commit loop (a read, however slow, never holds up a commit); else on the writer thread
    between commits (a write, in order with them). `passes`: the exceptions the caller gets as they are
    (a refusal it answers in words); any other becomes a RuntimeError with its message, since a future
    must settle whatever went wrong and not every exception survives the trip back."""

    function: Callable[[Context, Any], Any]
    beside: bool = False
    passes: tuple[type[Exception], ...] = ()


_HANDLERS: dict[type, Handler] = {}


def handles(
    kind: type[Request[Reply]], beside: bool = False, passes: tuple[type[Exception], ...] = ()
) -> Callable[[Callable[[Context, Any], Reply]], Callable[[Context, Any], Reply]]:
    """Register the decorated function as the answer to requests of type `kind` (see Handler)."""

    def register(function: Callable[[Context, Any], Reply]) -> Callable[[Context, Any], Reply]:
        if kind in _HANDLERS:
            raise TypeError(f"{kind.__name__} already has a handler")
        _HANDLERS[kind] = Handler(function, beside, passes)
        return function

    return register


def beside(request: Request) -> bool:
    """Whether `request` is answered beside the commit loop (see Handler)."""
    found = _HANDLERS.get(type(request))
    return found is not None and found.beside


def answer(context: Context, request: Request[Reply]) -> Reply:
    """Run `request`'s handler; an exception it does not pass is a RuntimeError with its message,
    and a request of a type without a handler a LookupError."""
    found = _HANDLERS.get(type(request))
    if found is None:
        raise LookupError(f"no handler for {type(request).__name__}")
    try:
        return found.function(context, request)
    except found.passes:
        raise
    except Exception as e:  # a future must settle, whatever went wrong
        raise RuntimeError(str(e)) from None
